"""The collectives of trunk replicas: rank 0's weights broadcast, weights averaged and compared, and a ``sync``
step's gradients all-reduced.

Each takes the replica's :class:`~splitfed.trunk.compute.runtime.TrunkRuntime`; every
rank calls it from its control loop, in the same order
(:class:`~splitfed.trunk.replicas.group.ReplicaGroup`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from splitfed.trunk.aggregation.contributions import Contribution, Grads
from splitfed.trunk.timeline import TIMELINE

if TYPE_CHECKING:
    from splitfed.trunk.compute.runtime import TrunkRuntime

__all__ = ["average_weights", "broadcast_weights", "max_divergence", "reduce_gradients"]


def _tensors(runtime: TrunkRuntime) -> list[torch.Tensor]:
    """Every floating parameter and buffer of the trunk, in module order (the same on every rank)."""
    trunk = runtime.trunk
    return [t for t in list(trunk.parameters()) + list(trunk.buffers()) if t.is_floating_point()]


def _flat(runtime: TrunkRuntime) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in _tensors(runtime)])


def _unflat(runtime: TrunkRuntime, flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for t in _tensors(runtime):
            t.copy_(flat[offset:offset + t.numel()].view_as(t).to(t.dtype))
            offset += t.numel()


def broadcast_weights(rt: TrunkRuntime) -> None:
    """Rank 0's weights and version, to every replica."""
    with rt._lock:
        flat = _flat(rt)
        dist.broadcast(flat, 0)
        _unflat(rt, flat)
        version = torch.tensor([rt._version], dtype=torch.int64, device=flat.device)
        dist.broadcast(version, 0)
        rt._version = int(version.item())


def average_weights(rt: TrunkRuntime, world_size: int) -> None:
    """Average every replica's weights; the version becomes max + 1 and pending forwards are rebased."""
    with rt._lock:
        rt._rebase_pending()
        flat = _flat(rt)
        dist.all_reduce(flat)
        _unflat(rt, flat / world_size)
        version = torch.tensor([rt._version], dtype=torch.int64, device=flat.device)
        dist.all_reduce(version, op=dist.ReduceOp.MAX)
        rt._version = int(version.item()) + 1


def max_divergence(rt: TrunkRuntime) -> float:
    """Max absolute difference between any replica's weights and rank 0's."""
    with rt._lock:
        mine = _flat(rt)
        ref = mine.clone()
        dist.broadcast(ref, 0)
        diff = (mine - ref).abs().max().reshape(1) if mine.numel() else torch.zeros(1, device=mine.device)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff.item())


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted ``indices`` as half-open runs of consecutive ones: [0, 1, 2, 5] -> [(0, 3), (5, 6)]."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def reduce_gradients(runtime: TrunkRuntime, contributions: Sequence[Contribution]) -> Grads | None:
    """The global update of a sync step: every replica's ``sum(weight * examples * grad)``, summed, over
    the sum of every replica's examples (None, on every rank, when no replica had examples).

    One buffer crosses: every parameter's weighted sum, then the examples and, per parameter, how many replicas
    have its gradient. It is filled and read with one fused call per contribution and per step (the parameters'
    views, ``torch._foreach_*``) and a fill per run of parameters for the counts, not with several calls per parameter.
    """
    params = runtime._trainable
    live = [c for c in contributions if c.grads is not None]
    sizes = [p.numel() for p in params]
    n = sum(sizes)
    device = params[0].device if params else torch.device("cpu")
    flat = torch.zeros(n + 1 + len(params), dtype=torch.float32, device=device)
    views = flat[:n].split(sizes)
    present: set[int] = set()
    for c in live:
        have = [i for i, g in enumerate(c.grads) if g is not None]  # type: ignore[arg-type]
        if have:
            torch._foreach_add_([views[i] for i in have],
                                [c.grads[i].reshape(-1).to(device, torch.float32) for i in have],  # type: ignore[index]
                                alpha=c.weight * c.num_examples)
        present.update(have)
    flat[n] = float(sum(c.num_examples for c in live))
    for lo, hi in _runs(sorted(present)):  # no host copy (it would wait for the device): a fill per run of indices
        flat[n + 1 + lo: n + 1 + hi].fill_(1.0)
    with TIMELINE.host("all-reduce", nbytes=flat.numel() * flat.element_size()):
        dist.all_reduce(flat)
        tail = flat[n:].tolist()  # one device-to-host copy: the examples and which gradients exist
    total = tail[0]
    if total <= 0:
        return None
    kept = [i for i in range(len(params)) if tail[1 + i] > 0]
    out: Grads = [None] * len(params)
    for i, g in zip(kept, torch._foreach_div([views[i] for i in kept], total) if kept else []):
        out[i] = g.view_as(params[i])
    return out
