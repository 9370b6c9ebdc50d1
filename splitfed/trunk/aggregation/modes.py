"""When and how client gradients update the trunk: sync, async and quorum modes (and the hooks of the others).

Pure logic: no gRPC, no Flower, no threads of its own. The trunk runtime hands
each client's trunk gradient to an aggregator as a :class:`Contribution` with
:meth:`TrunkAggregator.offer`, which returns at once with a future; the
aggregator calls back ``apply_update`` with the combined gradient whenever the
trunk should take an optimizer step, and resolves the futures of every gradient
that step decided. Nobody waits inside the aggregator: a server awaits the
futures, and whoever drives the aggregator calls :meth:`TrunkAggregator.poll`
at :meth:`TrunkAggregator.deadline` so that timeouts fire.

The three modes are one mechanism with different rules:

* a *bucket* collects gradients until :meth:`TrunkAggregator.ready` says it is
  complete (``sync``: every member of the step group contributed; ``quorum``:
  ``min(k, members)`` did; ``async``: one did);
* a member that has not been heard from (training forward, join or gradient)
  for ``timeout`` seconds and has no gradient in the open bucket is dropped from
  the group, in every mode; it rejoins with its next training forward. So a
  dead client holds up one step for at most ``timeout`` after its last sign of
  life, and a client that joined a moment ago is never dropped for the time the
  bucket had already been open;
* a gradient computed on an older trunk version is *stale*: its weight is
  :meth:`staleness_weight` of its staleness, or ``None`` to reject it. A stale
  gradient that may still be applied joins the open bucket like any other; the
  staleness and weight of every item are checked again when its bucket closes,
  and what a client is told is exactly what was applied;
* a step is all-or-nothing: if ``apply_update`` raises, every gradient of the
  bucket gets the same :class:`~splitfed.errors.TrunkStepError` and none of
  them is applied later.

Researchers subclass :class:`TrunkAggregator` (or one of the modes) and
override ``ready``, ``staleness_weight`` or ``combine``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from splitfed.errors import ConfigError, TrunkStepError
from splitfed.trunk.aggregation.contributions import (
    Bucket,
    Contribution,
    Grads,
    Offer,
    Outcome,
    Result,
    weighted_mean,
)
from splitfed.trunk.compute.requests import Promise, resolved

__all__ = ["AsyncAggregator", "Contribution", "CopyOptimizer", "Grads", "Outcome", "QuorumAggregator", "Result",
           "SyncAggregator", "TrunkAggregator", "make_aggregator", "weighted_mean"]

log = logging.getLogger(__name__)

ApplyUpdate = Callable[[Grads], None]
#: Builds the optimizer of one per-client trunk copy over its parameters.
CopyOptimizer = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
GetVersion = Callable[[], int]


class TrunkAggregator:
    """Base aggregator; see the module docstring for the shared mechanism.

    Args:
        max_staleness: versions a gradient may lag the trunk and still be applied.
        staleness_policy: ``reject`` drops gradients beyond ``max_staleness``;
            ``downweight`` applies them scaled by ``1 / (1 + staleness - max_staleness)``.
        timeout: seconds without a sign of life after which a member is dropped
            from the step group (and stops holding up the open bucket).
        clock: monotonic seconds (injected by tests).
    """

    mode = "base"

    def __init__(self, *, max_staleness: int = 0, staleness_policy: str = "reject", timeout: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_staleness < 0:
            raise ConfigError(f"max-staleness must be >= 0, got {max_staleness}")
        if staleness_policy not in ("reject", "downweight"):
            raise ConfigError(f"staleness-policy must be 'reject' or 'downweight', got {staleness_policy!r}")
        if timeout <= 0:
            raise ConfigError(f"trunk timeout must be > 0 seconds, got {timeout}")
        self.max_staleness = max_staleness
        self.staleness_policy = staleness_policy
        self.timeout = timeout
        self.clock = clock
        self._lock = threading.RLock()
        self._members: dict[str, float] = {}  # client -> last sign of life
        self._bucket = Bucket()
        self._steps_applied = 0
        self._get_version: GetVersion = lambda: self._steps_applied
        self._apply: ApplyUpdate | None = None
        self.stats: dict[str, int] = {o.value: 0 for o in Outcome} | {
            "dropped-members": 0, "expired-members": 0, "steps": 0, "failed-steps": 0}
        #: Called with ("wait_seconds" | "bucket_size" | "staleness", value); metrics hook in here.
        self.observer: Callable[[str, float], None] | None = None

    def _observe(self, kind: str, value: float) -> None:
        if self.observer is not None:
            self.observer(kind, value)

    # -- wiring -----------------------------------------------------------
    def bind(self, apply_update: ApplyUpdate, get_version: GetVersion | None = None) -> None:
        """Set the callback that steps the trunk and, optionally, where the trunk's version is read.

        ``apply_update`` must advance the version that ``get_version`` reports
        (the trunk runtime does both under one lock); without ``get_version`` the
        aggregator counts its own steps.
        """
        self._apply = apply_update
        if get_version is not None:
            self._get_version = get_version

    @property
    def version(self) -> int:
        """Trunk version: optimizer steps applied so far."""
        return self._get_version()

    @property
    def members(self) -> frozenset[str]:
        """Clients currently in the step group."""
        with self._lock:
            return frozenset(self._members)

    @property
    def offered(self) -> frozenset[str]:
        """Clients whose gradient waits in the open bucket for the next step."""
        with self._lock:
            return frozenset(self._bucket.clients)

    @property
    def pending(self) -> int:
        """Gradients waiting in the open bucket."""
        with self._lock:
            return len(self._bucket.items)

    def join(self, client_id: str) -> int:
        """Add a client to the step group (or mark it alive); returns the group size."""
        with self._lock:
            if client_id not in self._members:
                log.debug("client %s joined the trunk step group (%d members)", client_id, len(self._members) + 1)
            self._members[client_id] = self.clock()
            return len(self._members)

    def leave(self, client_id: str) -> int:
        """Remove a client from the step group; a bucket it held up may complete now."""
        with self._lock:
            if self._members.pop(client_id, None) is not None:
                log.debug("client %s left the trunk step group (%d members)", client_id, len(self._members))
                self._maybe_close()
            return len(self._members)

    # -- hooks of other modes (see splitfed.trunk.aggregation.percopy and splitfed.trunk.aggregation.turns) --------------
    def track_trunk(self, names: Sequence[str], params: Sequence[torch.Tensor]) -> None:
        """Called once by the runtime with the trunk's trainable parameters (and their names)."""

    def weights_for(self, client_id: str) -> list[torch.Tensor] | None:
        """The trainable weights a training forward of ``client_id`` runs on (None: the shared trunk)."""
        return None

    def begin_round(self, server_round: int, clients: Sequence[str]) -> None:
        """A round starts with these clients (called by the server side; ``clients`` as the trunk names them)."""

    def turn(self, client_id: str) -> Future[None] | None:
        """A future a client's training must await before it may use the trunk (None: no turns)."""
        return None

    # -- rules (override these) -------------------------------------------
    def ready(self, bucket_clients: set[str], members: set[str]) -> bool:
        """Whether the open bucket is complete."""
        raise NotImplementedError

    def staleness_weight(self, staleness: int) -> float | None:
        """Weight of a gradient ``staleness`` versions old, or ``None`` to reject it."""
        if staleness <= self.max_staleness:
            return 1.0
        if self.staleness_policy == "downweight":
            return 1.0 / (1 + staleness - self.max_staleness)
        return None

    def combine(self, contributions: Sequence[Contribution]) -> Grads | None:
        """Turn a bucket's gradients into one update (weighted mean by examples)."""
        return weighted_mean(contributions)

    # -- mechanism ----------------------------------------------------------
    def offer(self, c: Contribution) -> Future[Result]:
        """Hand over one gradient; returns at once with a future of what the mode decides for it."""
        if self._apply is None:
            raise RuntimeError("aggregator is not bound to a trunk; call bind() first")
        with self._lock:
            now = self.clock()
            for client in c.clients:
                self._members[client] = now
            staleness = max(self.version - c.version_seen, 0)
            self._observe("staleness", staleness)
            if c.grads is not None and staleness and self.staleness_weight(staleness) is None:
                return resolved(self._reject(c, staleness))  # it can only get staler
            item = Offer(c, Promise(), now)
            if self._bucket.opened is None:
                self._bucket.opened = now
            self._bucket.items.append(item)
            self._maybe_close()
            return item.future

    def submit(self, c: Contribution) -> Result:
        """Blocking :meth:`offer` for callers without a scheduler: waits, firing timeouts itself."""
        future = self.offer(c)
        return self.wait(future)

    def wait(self, future: Future[Result]) -> Result:
        """Wait for ``future``, calling :meth:`poll` whenever a deadline passes (for callers without a scheduler)."""
        while True:
            deadline = self.deadline()
            remaining = None if deadline is None else max(deadline - self.clock(), 0.0) + 0.001
            try:
                return future.result(timeout=remaining if remaining is not None else self.timeout)
            except FutureTimeout:
                self.poll()

    def deadline(self) -> float | None:
        """When :meth:`poll` next has something to do (a member falls silent), or None."""
        with self._lock:
            waiting = self._bucket.clients
            times = [seen + self.timeout for client, seen in self._members.items() if client not in waiting]
            return min(times) if times else None

    def poll(self) -> None:
        """Drop members silent for ``timeout`` and close the open bucket if that completes it."""
        with self._lock:
            now = self.clock()
            waiting = self._bucket.clients
            silent = [m for m, seen in self._members.items() if m not in waiting and now - seen >= self.timeout]
            if not silent:
                return
            holding_up = bool(self._bucket.items)
            for client_id in silent:
                del self._members[client_id]
                if holding_up:
                    self.stats["dropped-members"] += 1
                    log.warning("%s: dropped client %s from the step group: no sign of life within %.1fs",
                                self.mode, client_id, self.timeout)
                else:
                    self.stats["expired-members"] += 1
                    log.info("client %s left the trunk step group after %.1fs without a sign of life", client_id,
                             self.timeout)
            self.on_drop(silent, holding_up)
            self._maybe_close()

    def on_drop(self, dropped: list[str], held_up_a_step: bool) -> None:
        """Called when members are dropped for silence (``held_up_a_step``: a bucket was waiting)."""

    def _reject(self, c: Contribution, staleness: int) -> Result:
        self.stats[Outcome.REJECTED_STALE.value] += 1
        log.warning("rejected a gradient from client %s: %d versions stale (max %d)", c.client_id, staleness,
                    self.max_staleness)
        return Result(Outcome.REJECTED_STALE, self.version, staleness, 0.0)

    def _maybe_close(self) -> None:
        bucket = self._bucket
        if bucket.items and self.ready(bucket.clients, set(self._members)):
            self._close(bucket)

    def _close(self, bucket: Bucket) -> None:
        self._bucket = Bucket()
        now, version = self.clock(), self.version
        for item in bucket.items:  # waiting for a step is a sign of life
            for client in item.contribution.clients:
                if client in self._members:
                    self._members[client] = now
        decided: list[tuple[Offer, Result | None]] = []
        applied: list[Contribution] = []
        for item in bucket.items:
            c = item.contribution
            staleness = max(version - c.version_seen, 0)
            if c.grads is None:
                decided.append((item, Result(Outcome.REJECTED_GUARD, version, staleness, 0.0)))
                continue
            weight = self.staleness_weight(staleness)
            if weight is None:
                decided.append((item, self._reject(c, staleness)))
                continue
            c.weight = weight
            applied.append(c)
            decided.append((item, None))
        self._observe("bucket_size", len(applied))
        update = self.combine(applied)  # an empty step too: a replicated combine still joins the all-reduce
        try:
            if update is not None:
                self._step(update)
        except Exception as exc:  # all-or-nothing: every waiter learns it, nothing is retried
            self.stats["failed-steps"] += 1
            log.error("%s: the trunk step over %d gradients failed: %s", self.mode, len(applied), exc)
            error = TrunkStepError(f"the trunk step failed on the server ({type(exc).__name__}: {exc}); none of "
                                   f"the {len(applied)} gradients of that step was applied; run the forward again")
            for item, _ in decided:
                item.future.set_exception(error)
            return
        after = self.version
        for item, result in decided:
            c = item.contribution
            if result is None:
                staleness = max(version - c.version_seen, 0)
                outcome = Outcome.APPLIED if c.weight == 1.0 else Outcome.DOWNWEIGHTED
                if outcome is Outcome.DOWNWEIGHTED:
                    log.warning("applied a gradient from client %s %d versions stale with weight %.3g",
                                c.client_id, staleness, c.weight)
                result = Result(outcome, after, staleness, c.weight)
                self.stats[outcome.value] += 1
            elif result.outcome is Outcome.REJECTED_GUARD:
                self.stats[Outcome.REJECTED_GUARD.value] += 1
            self._observe("wait_seconds", now - item.offered)
            item.future.set_result(result)

    def _step(self, update: Grads) -> None:
        assert self._apply is not None
        self._apply(update)
        self._steps_applied += 1
        self.stats["steps"] += 1

    def describe(self) -> str:
        """One line for logs and ``summary()``."""
        return (f"{self.mode} (max-staleness={self.max_staleness}, policy={self.staleness_policy}, "
                f"timeout={self.timeout}s)")


class SyncAggregator(TrunkAggregator):
    """Wait for every member's gradient, average by examples, take one step.

    Equivalent to one large-batch SGD step on the union of the members'
    batches. A member silent for ``timeout`` seconds is dropped from the group
    (it rejoins with its next training forward).
    """

    mode = "sync"

    def ready(self, bucket_clients: set[str], members: set[str]) -> bool:
        return members <= bucket_clients


class QuorumAggregator(TrunkAggregator):
    """Step as soon as ``min(k, members)`` members sent a gradient (fresh or stale within the bound)."""

    mode = "quorum"

    def __init__(self, k: int, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        if k < 1:
            raise ConfigError(f"quorum must be >= 1, got {k}")
        self.k = k

    def ready(self, bucket_clients: set[str], members: set[str]) -> bool:
        return len(bucket_clients) >= min(self.k, max(len(members), 1))

    def describe(self) -> str:
        return f"quorum k={self.k}, " + super().describe()


class AsyncAggregator(TrunkAggregator):
    """Apply each gradient as it arrives; stale ones follow the staleness policy."""

    mode = "async"

    def ready(self, bucket_clients: set[str], members: set[str]) -> bool:
        return True


def make_aggregator(mode: str, *, quorum: int = 1, max_staleness: int = 0, staleness_policy: str = "reject",
                    timeout: float = 30.0, copy_optimizer: CopyOptimizer | None = None, proximal_mu: float = 0.0,
                    seed: int = 0) -> TrunkAggregator:
    """Build the aggregator for ``mode``: ``sync``, ``async``, ``quorum``, ``per-client`` (SplitFed V1, each
    client's copy stepped by ``copy_optimizer``, default SGD at lr 0.01) or ``sequential`` (SplitFed V2, turns in a
    permutation seeded by ``seed`` and the round)."""
    kwargs = dict(max_staleness=max_staleness, staleness_policy=staleness_policy, timeout=timeout)
    if mode == "sync":
        return SyncAggregator(**kwargs)  # type: ignore[arg-type]
    if mode == "async":
        return AsyncAggregator(**kwargs)  # type: ignore[arg-type]
    if mode == "quorum":
        return QuorumAggregator(quorum, **kwargs)  # type: ignore[arg-type]
    if mode == "per-client":
        from splitfed.trunk.aggregation.percopy import PerClientAggregator

        return PerClientAggregator(copy_optimizer, proximal_mu=proximal_mu, timeout=timeout)
    if mode == "sequential":
        from splitfed.trunk.aggregation.turns import SequentialAggregator

        return SequentialAggregator(seed=seed, timeout=timeout)
    raise ConfigError(f"trunk-mode must be sync, async, quorum, per-client or sequential, got {mode!r}")
