"""Trunk replicas over torch.distributed: one process group, a control loop per replica, the global sync step.

Each replica is a whole trunk (a :class:`~splitfed.trunk.compute.runtime.TrunkRuntime`
behind its own server) serving its own clients. :class:`ReplicaGroup` joins the
replicas' runtimes through the default ``torch.distributed`` process group
(NCCL when the trunks sit on GPUs, gloo on CPU) and runs one *control loop*
thread per replica; every collective of a replica is issued by that thread, in
the same order on every rank.

The control loop. At each tick (on a local change, at once; else every
``tick_s``) every replica all-reduces a small status vector over a gloo group:
how many replicas are ``idle`` (no step-group members), ``busy`` (members whose
gradients have not all arrived), ``ready`` (every member sent its gradient), and
the requests pending (parameter averaging, a weight check, leaving). Because a
replica with nothing to do still takes part in every tick, nobody waits on a
collective that one replica never enters, and a busy replica enters one at
least every ``tick_s``: the process group's timeout only fires for a replica
that is hung or gone.

``sync`` mode (:class:`ReplicaSyncAggregator`): a replica's aggregator never
steps on its own, neither before its group has formed (its server may already
serve) nor while the group lives. When a tick shows no busy replica and at
least one ready one, the step is *confirmed*: every replica takes its
aggregator's lock and its runtime's lock (so no gradient, join or forward can
slip in), checks again that it waits for nobody (no member without a gradient,
and no training forward saved on the current weights by a client not yet
counted as a member), and a second all-reduce says whether any replica does.
If none does, every replica closes its bucket under those locks and the step's
gradients are all-reduced: the sum of ``weight * examples * grad`` over every
client of every replica, divided by the sum of their examples (DDP semantics:
the same update one trunk serving all the clients would take). Every replica
applies it, so the weights stay identical. So a client with a training forward
outstanding on any replica when the step is taken belongs to the step; a
forward that starts after it runs on the new weights. A replica with no members
(or whose gradients the guard refused) adds zeros and still applies the
update; a step with no examples anywhere is skipped on every replica.

``async`` and ``quorum`` modes: each replica steps on its own schedule (a
global collective per gradient would force the lockstep those modes exist to
avoid); at the end of every round the replicas' weights are averaged
(:meth:`ReplicaGroup.average`, local SGD): they drift apart for at most a round.

Failures. A collective that fails (a replica died: gloo sees its sockets close;
or hung past the group's timeout) *breaks* the group: every survivor stops
taking part, its aggregator falls back to stepping alone, and ``on_broken`` is
called (the launcher keeps rank 0 serving and stops the others, whose clients
are moved to rank 0 at the next round). The group is not re-formed within a
run; restart with ``resume = true`` to get the replicas back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from splitfed.trunk.replicas import collectives
from splitfed.trunk.aggregation.contributions import Contribution, Grads
from splitfed.trunk.replicas.aggregation import (
    BUSY,
    IDLE,
    READY,
    ReplicaSyncAggregator,
    replica_aggregator,
)
from splitfed.trunk.timeline import TIMELINE

if TYPE_CHECKING:
    from splitfed.trunk.compute.runtime import TrunkRuntime

__all__ = ["ReplicaGroup", "ReplicaSyncAggregator", "init_timeout", "replica_aggregator"]

log = logging.getLogger(__name__)

# Fields of the status vector every tick all-reduces (SUM): IDLE, BUSY and READY (how many replicas are in each
# status, see :mod:`splitfed.trunk.replicas.aggregation`), then the requests pending.
_AVERAGE, _CHECK, _LEAVE = range(3, 6)


class ReplicaGroup:
    """This process's replica in the default process group, and its control loop.

    Create it after ``torch.distributed.init_process_group`` on every rank, then
    :meth:`start`. Rank 0's weights are broadcast to every replica at start.

    Args:
        runtime: this replica's trunk runtime.
        control: a gloo process group for the status ticks (None: the default group, when it is gloo).
        tick_s: how often an idle or busy replica takes part in a tick.
        on_broken: called (from the control loop) with the error when a collective fails; it reports the
            break (this group then logs the error at DEBUG only), else this group logs one WARNING.
    """

    def __init__(self, runtime: TrunkRuntime, *, control: Any = None, tick_s: float = 0.02,
                 on_broken: Callable[[BaseException], None] | None = None) -> None:
        self.runtime = runtime
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.control = control
        self.tick_s = tick_s
        self.on_broken = on_broken
        self.active = False
        self.error: BaseException | None = None
        self.stats: dict[str, int] = {"ticks": 0, "global-steps": 0, "vetoed-steps": 0, "averages": 0}
        #: The replicas' status at the last tick: how many were idle, busy and ready.
        self.last_tick: dict[str, int] = {"idle": 0, "busy": 0, "ready": 0}
        self._wake = threading.Event()
        self._requests = {_AVERAGE: 0, _CHECK: 0, _LEAVE: 0}
        self._done: dict[int, threading.Event] = {}
        self._last_check = float("nan")
        self._req_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._finished = threading.Event()
        agg = runtime.aggregator
        self.sync = isinstance(agg, ReplicaSyncAggregator)
        if agg.mode == "sync" and not self.sync:
            raise TypeError("a sync replica needs a ReplicaSyncAggregator (see replica_aggregator())")

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> ReplicaGroup:
        """Broadcast rank 0's weights and version (a collective), then run the control loop."""
        collectives.broadcast_weights(self.runtime)
        self.active = True
        if self.sync:
            self.runtime.aggregator.group = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._loop, name=f"splitfed-replica-{self.rank}", daemon=True)
        self._thread.start()
        log.info("trunk replica %d of %d joined (%s, %s)", self.rank, self.world_size, dist.get_backend(),
                 self.runtime.aggregator.describe())
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Leave the group: every replica's loop ends at the next tick (the others go on alone)."""
        if self.active:
            self._request(_LEAVE, wait=False)
        self.wait(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the control loop ended (left or broken); returns True if it did."""
        return self._finished.wait(timeout)

    def wake(self) -> None:
        """Something changed locally: take part in a tick now."""
        self._wake.set()

    # -- requests of rank 0 ------------------------------------------------------------------------------
    def _request(self, kind: int, wait: bool = True, timeout: float | None = None) -> bool:
        with self._req_lock:
            if not self.active:
                return False
            self._requests[kind] += 1
            done = self._done.setdefault(kind, threading.Event())
            done.clear()
        self.wake()
        return done.wait(timeout) if wait else True

    def average(self, timeout: float | None = None) -> bool:
        """Round end: average the weights of every replica (``async``/``quorum``; ``sync`` replicas are identical
        and this only checks it). Returns False when the group is not active."""
        if self.sync:
            divergence = self.divergence(timeout)
            if divergence > 1e-5:
                log.error("sync trunk replicas diverged: max |w - w_rank0| = %.3g; averaging them", divergence)
            else:
                return True
        return self._request(_AVERAGE, timeout=timeout)

    def divergence(self, timeout: float | None = None) -> float:
        """Max absolute difference between any replica's weights and rank 0's (a collective; NaN if inactive)."""
        if not self._request(_CHECK, timeout=timeout):
            return float("nan")
        return self._last_check

    # -- the control loop ------------------------------------------------------------------------------
    def _status(self) -> torch.Tensor:
        vec = torch.zeros(6, dtype=torch.float64)
        vec[self.runtime.aggregator.local_status() if self.sync else IDLE] = 1  # type: ignore[attr-defined]
        with self._req_lock:
            for kind, count in self._requests.items():
                vec[kind] = count
                self._requests[kind] = 0
        return vec

    def _loop(self) -> None:
        try:
            while True:
                self._wake.clear()
                vec = self._status()
                own_ready = bool(vec[READY])
                own, entered = int(vec[:READY + 1].argmax()), time.perf_counter()
                dist.all_reduce(vec, group=self.control)
                self.stats["ticks"] += 1
                TIMELINE.mark("replica-tick", own=own, ready=int(vec[READY]), busy=int(vec[BUSY]),
                              waited=time.perf_counter() - entered)
                self.last_tick = {"idle": int(vec[IDLE]), "busy": int(vec[BUSY]), "ready": int(vec[READY])}
                if vec[_LEAVE] > 0:
                    log.info("trunk replica %d: the group ends (a replica left)", self.rank)
                    break
                if vec[_AVERAGE] > 0:
                    self._average()
                    self._set_done(_AVERAGE)
                if vec[_CHECK] > 0:
                    self._last_check = collectives.max_divergence(self.runtime)
                    self._set_done(_CHECK)
                if self.sync and vec[BUSY] == 0 and vec[READY] > 0:
                    if self._confirmed_step():  # counted in it, before its outcome reaches a client
                        continue
                    self._wake.wait(self.tick_s)  # a replica waits for a forward's client: look again next tick
                    continue
                if not own_ready:  # a ready replica re-enters at once; the others at a change or a tick
                    self._wake.wait(self.tick_s)
        except Exception as exc:  # noqa: BLE001 - any failed collective breaks the group
            self.error = exc
            # A replica that dies or hangs is an expected event, not a bug here: the collective's error (gloo's
            # "Connection reset by peer" and its stack) goes to DEBUG. With ``on_broken`` its owner says what
            # happened in one line (which replica, what becomes of its clients); without, this one WARNING does.
            log.debug("trunk replica %d: a collective failed", self.rank, exc_info=True)
            if self.on_broken is None:
                log.warning("trunk replica %d: the replica group broke (%s); this replica leaves it and its trunk "
                            "steps alone from now on", self.rank, short_error(exc))
            self._end()
            if self.on_broken is not None:
                self.on_broken(exc)
            return
        self._end()

    def _confirmed_step(self) -> bool:
        """The tick proposed a step: under this replica's aggregator and runtime locks, check that it waits for
        nobody, agree on it with every replica (an all-reduce) and take it; False if a replica still waits."""
        agg = self.runtime.aggregator
        with agg._lock, self.runtime._lock:  # the aggregator's lock first, as a step takes them
            busy = agg.local_status(self._forwards_not_joined()) == BUSY  # type: ignore[attr-defined]
            votes, entered = torch.tensor([float(busy)], dtype=torch.float64), time.perf_counter()
            dist.all_reduce(votes, group=self.control)
            TIMELINE.mark("replica-vote", vetoed=int(votes.item() > 0), waited=time.perf_counter() - entered)
            if votes.item() > 0:
                self.stats["vetoed-steps"] += 1
                return False
            self.stats["global-steps"] += 1  # before the step settles its callers: a reply implies the count
            agg.close_global()  # type: ignore[attr-defined]
            return True

    def _forwards_not_joined(self) -> set[str]:
        """Clients with a training forward saved on the current weights within the member timeout: a forward
        between its computation and its client's join (the runtime joins outside its lock), or a member's.
        A member dropped for silence has none that recent. Call under the runtime's lock."""
        rt, agg = self.runtime, self.runtime.aggregator
        recent = time.monotonic() - agg.timeout
        return {e.client_id for e in rt.store.entries() if e.version == rt._version and e.created > recent
                and e.created > agg.left_at(e.client_id)}  # type: ignore[attr-defined]

    def _end(self) -> None:
        self.active = False
        if self.sync:
            self.runtime.aggregator.fall_back()  # type: ignore[attr-defined]
        with self._req_lock:
            for event in self._done.values():
                event.set()
        self._finished.set()

    def _set_done(self, kind: int) -> None:
        with self._req_lock:
            event = self._done.get(kind)
        if event is not None:
            event.set()

    # -- collectives ------------------------------------------------------------------------------------
    def _average(self) -> None:
        """Average every replica's weights; the version becomes max + 1 and pending forwards are rebased."""
        collectives.average_weights(self.runtime, self.world_size)
        self.stats["averages"] += 1
        log.info("trunk replica %d: weights averaged over %d replicas (version %d)", self.rank, self.world_size,
                 self.runtime._version)

    def reduce_gradients(self, contributions: Sequence[Contribution]) -> Grads | None:
        """The global update of a sync step (see :func:`~splitfed.trunk.replicas.collectives.reduce_gradients`)."""
        return collectives.reduce_gradients(self.runtime, contributions)


def short_error(exc: BaseException) -> str:
    """A failed collective's error in a few words for a log line: its first sentence, without the source path
    torch and gloo put in front (``[.../gloo/transport/tcp/pair.cc:537] Read error ...: Connection reset by
    peer. This is typically caused by ...`` becomes ``Read error ...: Connection reset by peer``)."""
    text = " ".join(str(exc).split())
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    first = text.split(". ", 1)[0].rstrip(".")
    return f"{type(exc).__name__}: {first[:200]}" if first else type(exc).__name__


def init_timeout(seconds: float) -> timedelta:
    """The process group's timeout: a collective waits at most this for a hung replica."""
    return timedelta(seconds=max(seconds, 10.0))
