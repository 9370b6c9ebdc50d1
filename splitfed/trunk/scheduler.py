"""The trunk's scheduler: one thread owns the trunk, requests from every client wait on futures.

Shape (after hivemind's ``Runtime`` and its task pools): the gRPC servicer
turns each request into a task and awaits its future; one device thread takes
tasks in arrival order, runs them on the trunk, and between tasks lets the
aggregator fire its deadlines (:meth:`TrunkRuntime.poll`) and the janitor
sweep expired state. A client waiting for a sync step or a quorum holds no
thread: its Backward's outcome is a future that the step resolves, so
hundreds of clients can wait on one server with a fixed number of threads.

Cross-client batching: with ``batch_window_ms > 0``, training forwards that
arrive within the window are run as one batched trunk call when the runtime
can batch them (:meth:`TrunkRuntime.forward_many`); each client still gets its
own output, saved forward and gradient. Inference sessions' decode steps that
arrive within the same window run as one batched call too (:meth:`TrunkScheduler.batched`,
:mod:`splitfed.trunk.inference.decoding`). Everything else (backwards, evaluation without a
window) runs one task at a time, in order. With the runtime's ``bring_early`` on, while a window of training
forwards stays open the device thread brings the tensors of those already in it to the device, a chunk at a time
(:mod:`splitfed.trunk.device.early`).

Small requests skip the hop: when the device thread is idle and nothing is
queued, :meth:`TrunkScheduler.now_or_queued` runs a small task on the caller's
thread at once (still one task at a time: the device thread and such callers
hold the same execution lock). Two thread switches cost more than a forward on
a few kilobytes, and small messages (decode steps, small batches) are where
that shows. :meth:`TrunkScheduler.inline` and :meth:`TrunkScheduler.forward_inline`
do the same without a future: the result, or :data:`MISS` when the caller must
submit the task instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, TypeVar

from splitfed.errors import TrunkBusyError
from splitfed.trunk.device.early import bring_forwards, chunk, unbrought
from splitfed.trunk.compute.requests import ForwardRequest, Promise
from splitfed.trunk.compute.runtime import TrunkRuntime
from splitfed.trunk.timeline import TIMELINE

log = logging.getLogger(__name__)

T = TypeVar("T")

#: A window of runner items (decode steps) closes ``batch_window_ms`` after the latest item joined it, but never
#: later than this many windows after the first item arrived (Triton's dynamic batcher bounds a request's queue
#: delay the same way).
ITEM_WINDOW_BOUND: Final[float] = 4.0

#: What :meth:`TrunkScheduler.inline` and :meth:`TrunkScheduler.forward_inline` return when the task did not run.
MISS: Final[Any] = object()


class BatchRunner(Protocol):
    """Work that batches on the device thread (e.g. inference sessions' decode steps)."""

    def run_one(self, item: Any) -> Any:
        """Run one item alone."""

    def run_many(self, items: list[Any]) -> list[Any]:
        """Run items collected within the window; one result or exception per item, in order."""

    def complete(self, items: list[Any]) -> bool:
        """Whether no other item is expected: the window may close early."""


@dataclass
class _Task:
    run: Callable[[], Any] | None
    future: Future[Any]
    forward: ForwardRequest | None = None  # batchable training forward
    runner: BatchRunner | None = None  # batches ``item`` with other items of the same runner
    item: Any = None
    tokens: int = 0
    queued: float = field(default_factory=time.monotonic)
    error: BaseException | None = None  # refused while its window was open (brought early: NaN or Inf)


class TrunkScheduler:
    """Runs every trunk operation on one device thread; callers get futures.

    Args:
        runtime: the trunk runtime it drives.
        batch_window_ms: how long a training forward may wait for others to batch with
            (0: no batching).
        max_batch_tokens: most positions (batch x length) one batched forward may hold.
        sweep_period_s: how often expired saved forwards (and ``on_sweep``) are swept.
        on_sweep: extra housekeeping run on the device thread at each sweep (e.g. sessions).
    """

    def __init__(self, runtime: TrunkRuntime, *, batch_window_ms: float = 0.0, max_batch_tokens: int = 1 << 16,
                 sweep_period_s: float = 5.0, on_sweep: Callable[[], Any] | None = None) -> None:
        if batch_window_ms < 0 or max_batch_tokens < 1:
            raise ValueError("batch_window_ms must be >= 0 and max_batch_tokens >= 1")
        self.runtime = runtime
        self.batch_window_s = batch_window_ms / 1000.0
        self.max_batch_tokens = max_batch_tokens
        self.sweep_period_s = sweep_period_s
        self.on_sweep = on_sweep
        self._queue: deque[_Task] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._exec = threading.Lock()  # held by whoever runs trunk work: the device thread or an inline caller
        # While a window is open, a put wakes the device thread only once the queue holds ``_wake_at`` tasks (the
        # members still missing could all be in) or the tokens put since it looked pass ``_room`` (the batch could
        # be full): not once per arrival, each wake a turn of the GIL taken from the event loop taking calls in.
        self._wake_at, self._room, self._since = 1, -1, 0
        self.stats: dict[str, int] = {"tasks": 0, "batched-forwards": 0, "forward-batches": 0, "inline": 0,
                                      "item-batches": 0, "batched-items": 0, "early-closes": 0,
                                      "early-brings": 0, "early-brought": 0, "early-refused": 0}

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> TrunkScheduler:
        """Start the device thread; returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="splitfed-trunk-device", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Finish the running task, fail the queued ones with :class:`TrunkBusyError`, end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._cond:
            left, self._queue = list(self._queue), deque()
        for task in left:
            task.future.set_exception(TrunkBusyError("the trunk server is shutting down; retry on another"))

    @property
    def running(self) -> bool:
        """Whether the device thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    # -- submitting -------------------------------------------------------------------------
    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn()`` on the device thread, in order with every other task."""
        return self._put(_Task(fn, Promise()))

    def wake(self) -> None:
        """Make the device thread look at the runtime's deadline again (it changed outside the thread)."""
        with self._cond:
            self._cond.notify()

    def now_or_queued(self, fn: Callable[[], T], *, small: bool) -> Future[T]:
        """Run a ``small`` task on the calling thread when the device thread is idle and nothing waits; else queue it.

        The returned future is already done when the task ran inline. Large tasks always go to the device thread
        (an event loop must not compute for long).
        """
        if small and not self._stopping and not self._queue and self._exec.acquire(blocking=False):
            try:
                future: Future[T] = Promise()
                self.stats["inline"] += 1
                self._settle(future, fn)
                return future
            finally:
                self._exec.release()
        return self.call(fn)

    def inline(self, fn: Callable[[], T], *, small: bool) -> T | Any:
        """``fn()`` run on the calling thread when ``small`` and the device thread is idle with nothing queued;
        else :data:`MISS` (``fn`` did not run). Its exceptions reach the caller; no future is made."""
        if small and not self._stopping and not self._queue and self._exec.acquire(blocking=False):
            try:
                self.stats["inline"] += 1
                with TIMELINE.host("inline"):
                    return fn()
            finally:
                self._exec.release()
        return MISS

    def forward_inline(self, request: ForwardRequest, *, small: bool) -> tuple[Any, int] | Any:
        """A ``small`` forward that would not batch, run at once on the calling thread when the trunk is idle;
        else :data:`MISS` (submit it with :meth:`forward`)."""
        if not small or (self.batch_window_s > 0 and self.runtime.can_batch(request)):
            return MISS
        return self.inline(lambda: self.runtime.forward_request(request), small=True)

    def forward(self, request: ForwardRequest, *, small: bool = False) -> Future[tuple[Any, int]]:
        """A forward, batched with others within the window when the runtime can.

        With no batching window, a ``small`` forward may run on the caller's thread (see :meth:`now_or_queued`).
        """
        batchable = self.batch_window_s > 0 and self.runtime.can_batch(request)
        if not batchable:
            return self.now_or_queued(lambda: self.runtime.forward_request(request), small=small)
        return self._put(_Task(None, Promise(), forward=request, tokens=request.tokens))

    def batched(self, runner: BatchRunner, item: Any, tokens: int = 1, *, small: bool = False) -> Future[Any]:
        """``runner``'s work on ``item``, batched with its other items within the window.

        With no window it runs alone (a ``small`` one maybe on the caller's thread, see :meth:`now_or_queued`).
        """
        if self.batch_window_s <= 0:
            return self.now_or_queued(lambda: runner.run_one(item), small=small)
        return self._put(_Task(None, Promise(), tokens=tokens, runner=runner, item=item))

    def _put(self, task: _Task) -> Future[Any]:
        with self._cond:
            if self._stopping:
                raise TrunkBusyError("the trunk server is shutting down; retry on another")
            self._queue.append(task)
            self._since += task.tokens
            if len(self._queue) >= self._wake_at or self._since > self._room:
                self._cond.notify()
        return task.future

    # -- the device thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        next_sweep = time.monotonic() + self.sweep_period_s
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    now = time.monotonic()
                    deadline = self.runtime.deadline()
                    wake = min(next_sweep, deadline) if deadline is not None else next_sweep
                    if wake <= now:
                        break
                    self._cond.wait(wake - now)
                if self._stopping:
                    return
                batch = self._take()
            with self._exec:
                if batch:
                    with TIMELINE.host("device", n=len(batch)):
                        self._run(batch)
                now = time.monotonic()
                deadline = self.runtime.deadline()
                backlog = self._backlog_since()
                # Liveness counts the clients' silence, not the server's own backlog: a member is judged only once
                # every request that reached the device queue before its deadline has run (one of them may be its
                # sign of life), and saved forwards expire only while the queue is no older than a sweep period.
                if deadline is not None and deadline <= now and (backlog is None or backlog >= deadline):
                    self._guarded(self.runtime.poll)
                if now >= next_sweep and (backlog is None or now - backlog < self.sweep_period_s):
                    next_sweep = now + self.sweep_period_s
                    self._guarded(self.runtime.sweep)
                    if self.on_sweep is not None:
                        self._guarded(self.on_sweep)

    def _backlog_since(self) -> float | None:
        """When the oldest task still queued arrived, or None when the queue is empty."""
        with self._cond:
            return self._queue[0].queued if self._queue else None

    def _take(self) -> list[_Task]:
        """The next task, or the next window of batchable forwards (caller holds the condition)."""
        if not self._queue:
            return []
        first = self._queue.popleft()
        if first.forward is None and first.runner is None:
            return [first]
        batch, tokens = [first], first.tokens
        close = first.queued + self.batch_window_s
        while True:
            for task in list(self._queue):
                if not self._joins(first, task):
                    continue
                if tokens + task.tokens > self.max_batch_tokens:
                    return batch
                self._queue.remove(task)
                batch.append(task)
                tokens += task.tokens
            if first.runner is not None:  # items (decode steps): open while they keep coming, within a bound
                close = min(max(t.queued for t in batch) + self.batch_window_s,
                            first.queued + ITEM_WINDOW_BOUND * self.batch_window_s)
            remaining = close - time.monotonic()
            missing = self._missing(batch)
            if remaining <= 0 or self._stopping or not missing:
                self.stats["early-closes"] += remaining > 0 and not self._stopping
                TIMELINE.mark("window", n=len(batch), waited=time.monotonic() - first.queued)
                return batch
            wake = missing
            if first.forward is not None and self.runtime.bring_early:  # see splitfed.trunk.device.early
                waiting, size = unbrought(batch), chunk(len(batch) + missing)
                if len(waiting) >= size:
                    self._bring_early(waiting)
                    continue  # calls came in meanwhile: look at the queue again
                wake = min(missing, size - len(waiting))  # woken for the next chunk too
            self._wake_at, self._room, self._since = len(self._queue) + wake, self.max_batch_tokens - tokens, 0
            try:
                self._cond.wait(remaining)
            finally:
                self._wake_at, self._room = 1, -1

    def _bring_early(self, waiting: list[_Task]) -> None:
        """Bring the tensors of forwards in an open window (:mod:`splitfed.trunk.device.early`); the caller holds the
        condition, let go meanwhile so that calls keep coming in."""
        self._cond.release()
        try:
            with TIMELINE.host("bring-early", n=len(waiting)):
                self.stats["early-refused"] += bring_forwards(self.runtime, waiting)
        except Exception as exc:  # noqa: BLE001 - these calls fail, as their batch would have; the thread goes on
            for task in waiting:
                task.error = exc
        finally:
            self._cond.acquire()
        self.stats["early-brings"] += 1
        self.stats["early-brought"] += len(waiting)

    @staticmethod
    def _joins(first: _Task, task: _Task) -> bool:
        if first.runner is not None:
            return task.runner is first.runner
        return task.forward is not None and task.forward.train == first.forward.train  # type: ignore[union-attr]

    def _missing(self, batch: list[_Task]) -> int:
        """How many more tasks the batch may get (0: close it now; 1 where only a new arrival can tell). A training
        batch gets no more once every step-group member has a forward in it or ran one for this step in an earlier
        batch (when ``max_batch_tokens`` split the step), whether its gradient came since or not."""
        if batch[0].runner is not None:
            return 0 if batch[0].runner.complete([t.item for t in batch]) else 1
        if not batch[0].forward or not batch[0].forward.train:  # type: ignore[union-attr]
            return 1
        members = self.runtime.aggregator.members
        if not members:
            return 1
        inside = {t.forward.client_id for t in batch}  # type: ignore[union-attr]
        ran = self.runtime.stepping()  # members whose forward already ran in an earlier batch of this step
        return sum(1 for m in members if m not in inside and m not in ran)

    def _run(self, batch: list[_Task]) -> None:
        self.stats["tasks"] += len(batch)
        if batch[0].runner is not None:
            self._run_items(batch)
            return
        if batch[0].forward is None:
            task = batch[0]
            assert task.run is not None
            self._settle(task.future, task.run)
            return
        for task in batch:
            if task.error is not None:  # refused while its window was open
                task.future.set_exception(task.error)
        batch = [t for t in batch if t.error is None]
        if not batch:
            return
        requests = [t.forward for t in batch]
        if len(batch) > 1:
            self.stats["forward-batches"] += 1
            self.stats["batched-forwards"] += len(batch)
        try:
            results = self.runtime.forward_many(requests)  # type: ignore[arg-type]
        except BaseException as exc:  # noqa: BLE001 - the callers get it
            for t in batch:
                t.future.set_exception(exc)
            return
        for t, result in zip(batch, results):
            if isinstance(result, BaseException):
                t.future.set_exception(result)
            else:
                t.future.set_result(result)

    def _run_items(self, batch: list[_Task]) -> None:
        runner = batch[0].runner
        assert runner is not None
        if len(batch) > 1:
            self.stats["item-batches"] += 1
            self.stats["batched-items"] += len(batch)
        try:
            results = runner.run_many([t.item for t in batch])
        except BaseException as exc:  # noqa: BLE001 - the callers get it
            results = [exc] * len(batch)
        for t, result in zip(batch, results):
            if isinstance(result, BaseException):
                t.future.set_exception(result)
            else:
                t.future.set_result(result)

    @staticmethod
    def _settle(future: Future[Any], fn: Callable[[], Any]) -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - the caller gets it
            future.set_exception(exc)
        else:
            future.set_result(result)

    @staticmethod
    def _guarded(fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception:  # housekeeping must never end the device thread
            log.exception("trunk housekeeping failed")
