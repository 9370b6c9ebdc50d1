"""Aggregation of trunk replicas: ``sync`` steps taken globally over a :class:`~splitfed.trunk.replicas.group.ReplicaGroup`.

A replica's ``sync`` aggregator never steps on its own, neither before its
group has formed (its server may already serve) nor while the group lives: the
group's control loop decides when a step happens and all-reduces its gradients
(see :mod:`splitfed.trunk.replicas.group`). ``async`` and ``quorum`` replicas keep
their mode's own aggregator: they step alone and are averaged at round end.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from splitfed.trunk.aggregation.modes import SyncAggregator, TrunkAggregator, make_aggregator
from splitfed.trunk.aggregation.contributions import Contribution, Grads, weighted_mean

if TYPE_CHECKING:
    from splitfed.trunk.replicas.group import ReplicaGroup

__all__ = ["BUSY", "IDLE", "READY", "ReplicaSyncAggregator", "replica_aggregator"]

#: A replica's status at a tick, each also its field of the status vector the tick all-reduces.
IDLE, BUSY, READY = range(3)


class ReplicaSyncAggregator(SyncAggregator):
    """``sync`` aggregation whose steps are global over a :class:`~splitfed.trunk.replicas.group.ReplicaGroup` (see
    :mod:`splitfed.trunk.replicas.group`).

    Until its group has formed it takes no step (its gradients wait for the
    group's first ticks); once the group has ended or broken it is a plain
    :class:`~splitfed.trunk.aggregation.modes.SyncAggregator`.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.group: ReplicaGroup | None = None
        self._alone = False  # the group ended: steps are local from then on
        self._left: dict[str, float] = {}  # client -> when it last left the group (its older forwards do not count)

    def _attached(self) -> bool:
        return self.group is not None and self.group.active

    def _maybe_close(self) -> None:
        if self._attached():
            assert self.group is not None
            self.group.wake()  # the control loop decides when the step happens
        elif self._alone:
            super()._maybe_close()
        # else the group has not formed yet: a step now would leave out the other replicas' clients

    def leave(self, client_id: str) -> int:
        with self._lock:
            now = time.monotonic()
            self._left = {c: t for c, t in self._left.items() if now - t < self.timeout}  # older ones count no more
            self._left[client_id] = now
            return super().leave(client_id)

    def left_at(self, client_id: str) -> float:
        """When ``client_id`` last left the step group (-inf if never): its forwards saved before then are not
        waited for."""
        with self._lock:
            return self._left.get(client_id, float("-inf"))

    def local_status(self, outstanding: Collection[str] = ()) -> int:
        """``IDLE``, ``BUSY`` or ``READY`` for this replica's step group and open bucket; ``outstanding``:
        clients with a training forward on the current weights that the step must also wait for."""
        with self._lock:
            waits_for = set(self._members).union(outstanding)
            if not waits_for and not self._bucket.items:
                return IDLE
            return READY if self._bucket.items and self.ready(self._bucket.clients, waits_for) else BUSY

    def close_global(self) -> None:
        """Close the open bucket (empty or not) into the global step; called by the control loop on every rank."""
        with self._lock:
            self._close(self._bucket)

    def combine(self, contributions: Sequence[Contribution]) -> Grads | None:
        if not self._attached():
            return weighted_mean(contributions)
        assert self.group is not None
        return self.group.reduce_gradients(contributions)

    def fall_back(self) -> None:
        """The group is gone: step alone from now on, closing the open bucket now if it is complete."""
        with self._lock:
            self._alone = True
            super()._maybe_close()

    def describe(self) -> str:
        return super().describe() + (f", global over {self.group.world_size} replicas" if self._attached() else "")


def replica_aggregator(mode: str, **kwargs: Any) -> TrunkAggregator:
    """The aggregator of one replica: :class:`ReplicaSyncAggregator` for ``sync``, else the mode's own
    (``async`` and ``quorum`` replicas step alone and are averaged at round end)."""
    if mode == "sync":
        kwargs.pop("quorum", None)
        return ReplicaSyncAggregator(**kwargs)
    return make_aggregator(mode, **kwargs)
