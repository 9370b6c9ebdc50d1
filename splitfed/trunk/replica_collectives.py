"""The collectives of trunk replicas: rank 0's weights broadcast, weights averaged and compared, and a ``sync``
step's gradients all-reduced.

Each takes the replica's :class:`~splitfed.trunk.runtime.TrunkRuntime`; every
rank calls it from its control loop, in the same order
(:class:`~splitfed.trunk.replicas.ReplicaGroup`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from splitfed.trunk.contributions import Contribution, Grads
from splitfed.trunk.timeline import TIMELINE

if TYPE_CHECKING:
    from splitfed.trunk.runtime import TrunkRuntime

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


def reduce_gradients(runtime: TrunkRuntime, contributions: Sequence[Contribution]) -> Grads | None:
    """The global update of a sync step: every replica's ``sum(weight * examples * grad)``, summed, over
    the sum of every replica's examples (None, on every rank, when no replica had examples)."""
    params = runtime._trainable
    live = [c for c in contributions if c.grads is not None]
    sizes = [p.numel() for p in params]
    device = params[0].device if params else torch.device("cpu")
    flat = torch.zeros(sum(sizes) + 1 + len(params), dtype=torch.float32, device=device)
    offset = 0
    for i, p in enumerate(params):
        for c in live:
            g = c.grads[i]  # type: ignore[index]
            if g is not None:
                flat[offset:offset + sizes[i]].add_(g.reshape(-1).to(device, torch.float32),
                                                    alpha=c.weight * c.num_examples)
                flat[sum(sizes) + 1 + i] = 1.0
        offset += sizes[i]
    flat[sum(sizes)] = float(sum(c.num_examples for c in live))
    with TIMELINE.host("all-reduce", nbytes=flat.numel() * flat.element_size()):
        dist.all_reduce(flat)
        tail = flat[sum(sizes):].cpu()  # one device-to-host copy: the examples and which gradients exist
    total = float(tail[0])
    if total <= 0:
        return None
    out: Grads = []
    offset = 0
    for i, p in enumerate(params):
        out.append((flat[offset:offset + sizes[i]] / total).view_as(p) if tail[1 + i] > 0 else None)
        offset += sizes[i]
    return out
