"""Async training forwards run on a copy of their version's weights, so that a step leaves their graph alone.

In ``async`` mode the trunk steps whenever a gradient comes, so while several clients train, other clients'
steps fall between a forward and its backward. A forward run on the live weights then loses its graph at the
step (the optimizer changes those weights in place): it is rebased onto a frozen copy of the weights it saw, and
its backward recomputes the forward on that copy (:mod:`splitfed.trunk.compute.recompute`), a second forward for each
gradient. Instead, while the step group has more than one member, an async forward runs from the start on a
copy of the weights of its version (:class:`VersionCopies`: one copy per version, made by the version's first
such forward and shared by the others), which no step changes. Its backward then takes the gradient for that
copy from the graph it kept: the gradient the rebased forward's recompute gives, without the second forward.

The copies are the store's frozen weight copies (:meth:`~splitfed.trunk.compute.store.ForwardStore.add_copy`):
``StoreLimits.max_frozen`` bounds them and ``max_bytes`` counts them, as for rebased forwards, and a copy goes
once its version has passed and no forward uses it. Such forwards keep what autograd saved until their
backward, as a sync step's forwards do, where a rebased forward kept only its input.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from splitfed.trunk.compute.store import ForwardStore, FrozenWeights

if TYPE_CHECKING:
    from splitfed.trunk.compute.runtime import TrunkRuntime

__all__ = ["VersionCopies"]

log = logging.getLogger(__name__)

#: The aggregation modes whose training forwards run on their version's copy (see the module's docstring).
VERSIONED_MODES = frozenset({"async"})


class VersionCopies:
    """The copy of the trunk's trainable weights at the current version, for the forwards that run on it."""

    def __init__(self, store: ForwardStore) -> None:
        self.store = store
        self.current: FrozenWeights | None = None
        #: Copies made (one per version that had such a forward).
        self.made = 0

    def for_forward(self, rt: TrunkRuntime, weights: Sequence[torch.Tensor] | None) -> FrozenWeights | None:
        """The copy a training forward of ``rt`` runs on: in a mode of :data:`VERSIONED_MODES` with other clients
        in the step group, whose steps may come before its backward. None otherwise (the live weights, or
        ``weights``: a client's own trunk copy in ``per-client`` mode), and with activation checkpointing (which
        keeps no graph)."""
        agg = rt.aggregator
        if weights is not None or rt.checkpointing or agg.mode not in VERSIONED_MODES or len(agg.members) < 2:
            return None
        return self.take(rt.version, rt._trainable)

    def take(self, version: int, trainable: Sequence[torch.Tensor]) -> FrozenWeights:
        """The copy of ``trainable`` at ``version``, made now if this version has none yet (the caller holds the
        runtime's lock; the copy's kernels are queued before any later step's)."""
        current = self.current
        if current is None or current.version != version:
            self.retire()
            with torch.no_grad():
                params = [p.detach().clone().requires_grad_(True) for p in trainable]
            current = self.current = self.store.add_copy(version, params)
            self.made += 1
        return current  # counted again, if its users all went meanwhile, by the store's add of the forward

    def retire(self) -> None:
        """The current version is over (a step): its copy stays only while forwards still use it."""
        if self.current is not None:
            self.store.release_copy(self.current)
            self.current = None

    def before_step(self, rt: TrunkRuntime) -> None:
        """``rt`` is about to step: the current version's copy stays only while forwards use it, and the forwards
        still waiting for their backward on the live weights (single or batched) are rebased onto one frozen copy
        of them, their graphs dropped (their backward recomputes)."""
        self.retire()
        pending = [e for e in self.store.entries() if e.frozen is None and e.group is None]
        waiting = [g for g in rt._batches.groups if g.frozen is None]
        if not pending and not waiting:
            return
        frozen = [p.detach().clone().requires_grad_(True) for p in rt._trainable]
        self.store.freeze(pending, rt.version, frozen)
        rt.stats["rebased"] += len(pending) + rt._batches.rebase(frozen)
        log.debug("rebased %d pending forwards before trunk step %d", len(pending), rt.version + 1)
