"""An asyncio event loop run on a thread of its own, as the trunk server and the router run theirs, and how that
loop awaits what other threads (the trunk's device thread) settle."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from splitfed.errors import ConfigError

T = TypeVar("T")


#: Python 3.12+ can start a task eagerly: it runs up to its first suspension at once, and a call that never
#: suspends (an inline trunk call) finishes without a turn of the event loop.
_EAGER: Callable[..., asyncio.Task[Any]] | None = getattr(asyncio, "eager_task_factory", None)


def own_task(coro: Any) -> asyncio.Future[Any]:
    """``coro`` in a task of its own (cancelling its awaiter leaves it running), started eagerly where asyncio
    can."""
    if _EAGER is not None:
        return _EAGER(asyncio.get_running_loop(), coro)
    return asyncio.ensure_future(coro)


def own_work(coro: Any) -> asyncio.Future[Any]:
    """:func:`own_task` started eagerly on every Python: ``coro`` runs up to its first suspension at once, and work
    that never suspends (an inline trunk call) ends without a turn of the event loop.

    On Python 3.11 that first step runs in the caller's task (``asyncio.current_task()`` is the caller's until
    the work first suspends): only for work that never asks for its own task.
    """
    if _EAGER is not None:
        return _EAGER(asyncio.get_running_loop(), coro)
    return _started(coro)


def _started(coro: Any) -> asyncio.Future[Any]:
    """Python 3.11's eager start: the first step of ``coro`` now; a task carries on from its first suspension."""
    loop = asyncio.get_running_loop()
    try:
        yielded = coro.send(None)
    except StopIteration as done:
        settled: asyncio.Future[Any] = loop.create_future()
        settled.set_result(done.value)
        return settled
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - the task's outcome, as a task would hold it
        settled = loop.create_future()
        if isinstance(exc, asyncio.CancelledError):
            settled.cancel()
        else:
            settled.set_exception(exc)
        return settled
    return asyncio.ensure_future(_resumed(coro, yielded))


async def _resumed(coro: Any, yielded: Any) -> Any:
    return await _delegate(coro, yielded)


@types.coroutine
def _delegate(coro: Any, yielded: Any) -> Any:
    """What ``await`` does for a coroutine already started: hand each value it yields (a future to wait for) to
    the task, and the task's answer (or its cancellation) back to it."""
    while True:
        try:
            sent = yield yielded
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:  # noqa: BLE001 - thrown in by the task (a cancellation): the coroutine's to handle
            try:
                yielded = coro.throw(exc)
            except StopIteration as done:
                return done.value
        else:
            try:
                yielded = coro.send(sent)
            except StopIteration as done:
                return done.value


#: Work whose caller stopped waiting (see :func:`shielded_work`), held until it ends: the loop keeps only weak
#: references to tasks.
_DETACHED: set[asyncio.Future[Any]] = set()


def shielded_work(coro: Any) -> tuple[asyncio.Future[Any], asyncio.Future[Any]]:
    """``coro`` started as :func:`own_work`, and a future of its outcome that the caller awaits: cancelling that
    future (the call was cancelled) leaves the work running, as awaiting ``asyncio.shield(work)`` would.

    The work settles the future from within its own last step, where a shield's future is settled by a done
    callback of the work's task: one turn of the event loop less per call, and two callbacks less. Returns the
    future and the work (hold the work until it ends; :func:`detach` it when the caller stops waiting).
    """
    outer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    return outer, own_work(_settle_into(coro, outer))


async def _settle_into(coro: Any, outer: asyncio.Future[Any]) -> None:
    try:
        result = await coro
    except asyncio.CancelledError:  # the work itself was cancelled (its loop is stopping)
        if not outer.done():
            outer.cancel()
    except (KeyboardInterrupt, SystemExit):  # pragma: no cover - the process is ending
        raise
    except BaseException as exc:  # noqa: BLE001 - the caller's to raise
        if not outer.done():
            outer.set_exception(exc)
        outer = exc = None  # type: ignore[assignment] # the traceback holds this frame: no cycle through the future
    else:
        if not outer.done():
            outer.set_result(result)


def detach(work: asyncio.Future[Any]) -> None:
    """Let ``work`` (from :func:`shielded_work`) finish on its own, held until it ends."""
    if not work.done():
        _DETACHED.add(work)
        work.add_done_callback(_DETACHED.discard)


#: Seconds the tasks still pending on a stopping loop have to end once cancelled.
CANCEL_GRACE_S = 2.0


async def _cancel_pending(grace: float) -> None:
    """Cancel every task of the running loop but this one and give them ``grace`` seconds to end (their
    outcomes read, so none is reported as never retrieved)."""
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=grace)
    for task in tasks:
        if task.done():
            task.cancelled() or task.exception()


def stop_loop(loop: asyncio.AbstractEventLoop | None, thread: threading.Thread | None) -> None:
    """Cancel what still runs on ``loop`` (running forever on ``thread``): work detached from calls that were
    answered or cancelled, which would otherwise be destroyed pending with the loop. Then stop it, wait up to 5 s
    for the thread, and close the loop once it no longer runs."""
    if loop is None or thread is None:
        return
    if loop.is_running() and threading.current_thread() is not thread:
        try:
            asyncio.run_coroutine_threadsafe(_cancel_pending(CANCEL_GRACE_S), loop).result(CANCEL_GRACE_S + 3)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass  # a loop that does not answer is stopped all the same
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    if not loop.is_running():
        loop.close()


class LoopThread:
    """An asyncio event loop that runs forever on a daemon thread of its own, as a server that serves from
    ``grpc.aio`` runs one beside its caller's threads: started once, run into from any other thread, stopped once.

    ``what`` names the owner in the error a call before :meth:`start` gets ("the trunk server")."""

    def __init__(self, name: str, what: str) -> None:
        self.name = name
        self.what = what
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.stopped = threading.Event()

    @property
    def running(self) -> bool:
        """Whether the loop is started and running."""
        return self.loop is not None and self.loop.is_running()

    def start(self) -> asyncio.AbstractEventLoop:
        """Start the loop on its thread; returns the loop."""
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=self.name, daemon=True)
        self.thread.start()
        return self.loop

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        """Run ``coro`` on the loop from another thread and return its result (``timeout`` seconds at most)."""
        if self.loop is None:
            coro.close()
            raise ConfigError(f"{self.what} is not started; call start() first")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        """Cancel what still runs on the loop, stop it and close it (:func:`stop_loop`)."""
        stop_loop(self.loop, self.thread)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the owner marks :attr:`stopped` (or ``timeout``); returns True if it timed out."""
        return not self.stopped.wait(timeout)


def awaiting(future: concurrent.futures.Future[T]) -> asyncio.Future[T]:
    """An asyncio future, on the running loop, that takes ``future``'s outcome once another thread settles it.

    Cancelling it (its call was cancelled: the client died or gave up) leaves ``future`` alone, so the work and
    the step it belongs to go on for the others; nothing is set on a cancelled waiter. This is
    ``asyncio.shield(asyncio.wrap_future(future))`` with one asyncio future and one callback instead of three
    and four, on every trunk call's path.
    """
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[T] = loop.create_future()
    if future.done():
        _settle(future, waiter)
        return waiter

    mailbox = mailbox_of(loop)
    future.add_done_callback(lambda settled: mailbox.post(_settle, settled, waiter))
    return waiter


def _settle(source: concurrent.futures.Future[T], waiter: asyncio.Future[T]) -> None:
    if waiter.done():  # cancelled while the work ran
        return
    if source.cancelled():
        waiter.cancel()
        return
    error = source.exception()
    if error is not None:
        waiter.set_exception(error)
    else:
        waiter.set_result(source.result())


class Mailbox:
    """Callbacks that other threads post to one event loop, run in the loop's thread in the order posted.

    ``loop.call_soon_threadsafe`` wakes the loop once per callback: a write to its self-pipe, a system call in
    which the posting thread lets go of the interpreter lock, and must then win it back from the loop it has just
    woken. The trunk's device thread settles a whole batch's calls at once (32 replies after a step), so it paid
    that hand-over once per call. A mailbox wakes the loop once for everything posted until the loop drains it.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # Weakly: the loop's entry in ``_MAILBOXES`` must go with the loop, and a mailbox holding the loop would
        # keep it (and every closed loop's mailbox) alive for good.
        self._loop = weakref.ref(loop)
        self._items: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = collections.deque()
        self._lock = threading.Lock()
        self._scheduled = False
        self.wakeups = 0  # how many times a post woke the loop (the rest rode along)

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` soon in the loop's thread (from any thread). Dropped when the loop has closed: nobody
        waits on it any more."""
        with self._lock:
            self._items.append((fn, args))
            if self._scheduled:
                return
            self._scheduled = True
            self.wakeups += 1
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("the event loop is gone")
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop closed meanwhile: nobody waits any more
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, collections.deque()
            self._scheduled = False
        for fn, args in items:
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - one callback's failure must not drop the others
                loop = self._loop()
                if loop is not None:
                    loop.call_exception_handler({"message": "a callback posted to the loop failed",
                                                 "exception": exc})


_MAILBOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()
_MAILBOXES_LOCK = threading.Lock()


def mailbox_of(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """``loop``'s :class:`Mailbox` (one per loop, made on first use)."""
    box = _MAILBOXES.get(loop)
    if box is None:
        with _MAILBOXES_LOCK:
            box = _MAILBOXES.get(loop)
            if box is None:
                box = _MAILBOXES[loop] = Mailbox(loop)
    return box
