"""When and how client gradients update the trunk: sync, async and quorum modes.

Pure logic: no gRPC, no Flower. The trunk runtime hands each client's trunk
gradient to an aggregator as a :class:`Contribution` and blocks as long as the
mode says; the aggregator calls back ``apply_update`` with the weighted
gradients whenever the trunk should take an optimizer step.

The three modes are one mechanism with different rules:

* a *bucket* collects gradients computed on the current trunk version;
* :meth:`TrunkAggregator.ready` says when the bucket is complete (``sync``: every
  member of the step group contributed; ``quorum``: k of them did; ``async``: one);
* a bucket still open ``timeout`` seconds after its first gradient is applied
  with what it holds (``sync`` also drops the members that did not contribute);
* a gradient computed on an older version is *stale*: :meth:`staleness_weight`
  returns its weight, or ``None`` to reject it; stale gradients that are not
  rejected are applied on their own.

Researchers subclass :class:`TrunkAggregator` (or one of the modes) and
override ``ready``, ``staleness_weight`` or ``combine``.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from splitfed.errors import ConfigError

log = logging.getLogger(__name__)

Grads = list[torch.Tensor | None]


class Outcome(str, enum.Enum):
    """What happened to one client's gradient."""

    APPLIED = "applied"
    DOWNWEIGHTED = "downweighted"
    REJECTED_STALE = "rejected-stale"
    REJECTED_GUARD = "rejected-guard"
    NOT_TRAINED = "not-trained"


@dataclass
class Contribution:
    """One client's trunk gradient for one forward.

    ``grads`` is aligned with the trunk's trainable parameters; ``None`` for an
    abstention (the gradient was refused by the guard but the client still
    counts as having answered this step).
    """

    client_id: str
    version_seen: int
    grads: Grads | None
    num_examples: int = 1
    weight: float = 1.0


@dataclass(frozen=True)
class Result:
    """What :meth:`TrunkAggregator.submit` reports back to the client."""

    outcome: Outcome
    version: int
    staleness: int
    weight: float = 1.0


@dataclass
class _Bucket:
    generation: int
    opened: float | None = None
    items: list[Contribution] = field(default_factory=list)
    clients: set[str] = field(default_factory=set)
    result: dict[int, Result] = field(default_factory=dict)  # by id() of the Contribution


ApplyUpdate = Callable[[Grads], None]
GetVersion = Callable[[], int]


def weighted_mean(contributions: Sequence[Contribution]) -> Grads | None:
    """Sum of ``weight * num_examples * grad`` over the sum of ``num_examples``.

    With equal weights this is the gradient of the mean loss over the union of
    the clients' batches (each client sends the gradient of its batch-mean loss).
    """
    live = [c for c in contributions if c.grads is not None]
    if not live:
        return None
    total = float(sum(c.num_examples for c in live))
    out: Grads = []
    for i in range(len(live[0].grads)):  # type: ignore[arg-type]
        acc: torch.Tensor | None = None
        for c in live:
            g = c.grads[i]  # type: ignore[index]
            if g is None:
                continue
            term = g * (c.weight * c.num_examples / total)
            acc = term if acc is None else acc.add_(term)
        out.append(acc)
    return out


class TrunkAggregator:
    """Base aggregator; see the module docstring for the shared mechanism.

    Args:
        max_staleness: versions a gradient may lag the trunk and still be applied.
        staleness_policy: ``reject`` drops gradients beyond ``max_staleness``;
            ``downweight`` applies them scaled by ``1 / (1 + staleness - max_staleness)``.
        timeout: seconds a bucket waits after its first gradient before it is applied
            with what it holds.
    """

    mode = "base"

    def __init__(self, *, max_staleness: int = 0, staleness_policy: str = "reject", timeout: float = 30.0) -> None:
        if max_staleness < 0:
            raise ConfigError(f"max-staleness must be >= 0, got {max_staleness}")
        if staleness_policy not in ("reject", "downweight"):
            raise ConfigError(f"staleness-policy must be 'reject' or 'downweight', got {staleness_policy!r}")
        if timeout <= 0:
            raise ConfigError(f"trunk timeout must be > 0 seconds, got {timeout}")
        self.max_staleness = max_staleness
        self.staleness_policy = staleness_policy
        self.timeout = timeout
        self._cond = threading.Condition()
        self._members: set[str] = set()
        self._bucket = _Bucket(generation=0)
        self._steps_applied = 0
        self._get_version: GetVersion = lambda: self._steps_applied
        self._apply: ApplyUpdate | None = None
        self.stats: dict[str, int] = {o.value: 0 for o in Outcome} | {"dropped-members": 0, "steps": 0}
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
        with self._cond:
            return frozenset(self._members)

    def join(self, client_id: str) -> int:
        """Add a client to the step group; returns the group size."""
        with self._cond:
            if client_id not in self._members:
                self._members.add(client_id)
                log.info("client %s joined the trunk step group (%d members)", client_id, len(self._members))
            return len(self._members)

    def leave(self, client_id: str) -> int:
        """Remove a client from the step group; a bucket it held up may complete now."""
        with self._cond:
            if client_id in self._members:
                self._members.discard(client_id)
                log.info("client %s left the trunk step group (%d members)", client_id, len(self._members))
                self._maybe_apply()
            return len(self._members)

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
    def submit(self, c: Contribution) -> Result:
        """Hand over one gradient; blocks until the mode has decided what to do with it."""
        if self._apply is None:
            raise RuntimeError("aggregator is not bound to a trunk; call bind() first")
        entered = time.monotonic()
        with self._cond:
            self._members.add(c.client_id)
            staleness = self.version - c.version_seen
            self._observe("staleness", max(staleness, 0))
            if staleness > 0:
                return self._handle_stale(c, staleness)
            bucket = self._bucket
            if bucket.opened is None:
                bucket.opened = time.monotonic()
            bucket.items.append(c)
            bucket.clients.add(c.client_id)
            self._maybe_apply()
            while id(c) not in bucket.result:
                remaining = bucket.opened + self.timeout - time.monotonic()
                if remaining <= 0:
                    self._apply_on_timeout(bucket)
                    break
                self._cond.wait(remaining)
            self._observe("wait_seconds", time.monotonic() - entered)
            return bucket.result[id(c)]

    def _handle_stale(self, c: Contribution, staleness: int) -> Result:
        weight = None if c.grads is None else self.staleness_weight(staleness)
        if weight is None:
            outcome = Outcome.REJECTED_GUARD if c.grads is None else Outcome.REJECTED_STALE
            self.stats[outcome.value] += 1
            if outcome is Outcome.REJECTED_STALE:
                log.warning("rejected a gradient from client %s: %d versions stale (max %d)", c.client_id,
                            staleness, self.max_staleness)
            return Result(outcome, self.version, staleness, 0.0)
        c.weight = weight
        self._step(self.combine([c]))
        outcome = Outcome.APPLIED if weight == 1.0 else Outcome.DOWNWEIGHTED
        if outcome is Outcome.DOWNWEIGHTED:
            log.warning("applied a gradient from client %s %d versions stale with weight %.3g", c.client_id,
                        staleness, weight)
        self.stats[outcome.value] += 1
        return Result(outcome, self.version, staleness, weight)

    def _maybe_apply(self) -> None:
        bucket = self._bucket
        if bucket.items and self.ready(bucket.clients, self._members):
            self._close(bucket)

    def _apply_on_timeout(self, bucket: _Bucket) -> None:
        if bucket is not self._bucket or bucket.result:
            return
        missing = self._members - bucket.clients
        log.warning("%s step timed out after %.1fs with %d of %d gradients", self.mode, self.timeout,
                    len(bucket.clients), len(self._members))
        self.on_timeout(missing)
        self._close(bucket)

    def on_timeout(self, missing: set[str]) -> None:
        """Called when a bucket times out, with the members that did not contribute."""

    def _close(self, bucket: _Bucket) -> None:
        self._observe("bucket_size", len(bucket.items))
        update = self.combine(bucket.items)
        if update is not None:
            self._step(update)
        for c in bucket.items:
            outcome = Outcome.APPLIED if c.grads is not None else Outcome.REJECTED_GUARD
            self.stats[outcome.value] += 1
            bucket.result[id(c)] = Result(outcome, self.version, 0, c.weight)
        self._bucket = _Bucket(generation=bucket.generation + 1)
        self._cond.notify_all()

    def _step(self, update: Grads | None) -> None:
        if update is None:
            return
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

    def on_timeout(self, missing: set[str]) -> None:
        for client_id in missing:
            log.warning("sync: dropped client %s from the step group: no gradient within %.1fs", client_id,
                        self.timeout)
            self._members.discard(client_id)
            self.stats["dropped-members"] += 1


class QuorumAggregator(TrunkAggregator):
    """Step as soon as ``k`` members (or all, if fewer) sent their gradient, or on timeout."""

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
                    timeout: float = 30.0) -> TrunkAggregator:
    """Build the aggregator for ``mode`` (``sync``, ``async`` or ``quorum``)."""
    kwargs = dict(max_staleness=max_staleness, staleness_policy=staleness_policy, timeout=timeout)
    if mode == "sync":
        return SyncAggregator(**kwargs)  # type: ignore[arg-type]
    if mode == "async":
        return AsyncAggregator(**kwargs)  # type: ignore[arg-type]
    if mode == "quorum":
        return QuorumAggregator(quorum, **kwargs)  # type: ignore[arg-type]
    raise ConfigError(f"trunk-mode must be sync, async or quorum, got {mode!r}")
