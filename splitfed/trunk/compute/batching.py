"""Cross-client batching: pack several clients' cut states into one trunk call, and take it apart again.

Sequences of different lengths are padded on the right, with the padding
masked out: the trunk's layers are causal (decoders) or masked (encoders), so a
real position never sees a padded one and each client's rows and positions
compute exactly what they would alone. Only the shapes differ, so results
match the unbatched trunk to float rounding.

A batched training forward becomes a :class:`ForwardGroup`: one graph for all
its clients. Its backward runs once, when every member sent its gradient (or
was dropped from the step group): each client's output gradient is weighted by
its share of the group's examples, so the trunk's gradient is the same
example-weighted sum the aggregator would form from separate backwards, and
each input gradient is scaled back to the client's own.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from splitfed.split.base import CutState
from splitfed.trunk.aggregation.contributions import Result
from splitfed.trunk.compute.requests import Promise


def batch_key(state: CutState) -> tuple[Any, ...] | None:
    """States with equal keys can share a trunk call; None for states that cannot be batched."""
    h = state.hidden
    if h.dim() == 3:  # (batch, length, hidden): any length, same width
        if state.attention_mask is not None and state.attention_mask.shape[1] != h.shape[1]:
            return None  # a cached past (inference sessions) never batches here
        return ("seq", h.shape[2], h.dtype, state.position_ids is not None, state.blocks)
    if h.dim() >= 2:  # images and flat features: same trailing shape (and the same blocks to run)
        return ("flat", tuple(h.shape[1:]), h.dtype, state.blocks)
    return None


@dataclass(frozen=True)
class Packed:
    """Several states as one: the batched state, and each one's rows and length in it."""

    state: CutState
    rows: list[slice]
    lengths: list[int]

    def part(self, out: torch.Tensor, i: int) -> torch.Tensor:
        """Client ``i``'s share of a batched output (its rows, its real positions)."""
        rows = out[self.rows[i]]
        return rows[:, : self.lengths[i]] if out.dim() >= 3 and self.lengths[i] >= 0 else rows


def pack(states: list[CutState]) -> Packed:
    """Concatenate states with equal :func:`batch_key` along the batch, right-padding sequences."""
    rows, start = [], 0
    for s in states:
        rows.append(slice(start, start + s.hidden.shape[0]))
        start += s.hidden.shape[0]
    if states[0].hidden.dim() != 3:
        return Packed(CutState(torch.cat([s.hidden for s in states]), blocks=states[0].blocks), rows,
                      [-1] * len(states))
    lengths = [s.hidden.shape[1] for s in states]
    longest = max(lengths)
    padded = any(n != longest for n in lengths) or any(s.attention_mask is not None for s in states)
    hidden = torch.cat([_pad(s.hidden, longest, 0.0) for s in states])
    mask = None
    if padded:
        mask = torch.cat([_pad(s.attention_mask if s.attention_mask is not None else
                               torch.ones(s.hidden.shape[:2], dtype=torch.long), longest, 0).long()
                          for s in states])
    positions = None
    if states[0].position_ids is not None:
        positions = torch.cat([_pad(s.position_ids.expand(s.hidden.shape[0], -1), longest, 0) for s in states])
    return Packed(CutState(hidden, mask, positions, states[0].blocks), rows, lengths)


def _pad(t: torch.Tensor, length: int, value: float) -> torch.Tensor:
    missing = length - t.shape[1]
    if not missing:
        return t
    shape = (t.shape[0], missing) + tuple(t.shape[2:])
    return torch.cat([t, torch.full(shape, value, dtype=t.dtype, device=t.device)], dim=1)


@dataclass(eq=False)  # a group is itself: found in lists by identity, never by comparing its tensors
class ForwardGroup:
    """A batched training forward of several clients, waiting for their gradients."""

    packed: Packed
    leaf: torch.Tensor
    output: torch.Tensor | None
    version: int
    clients: list[str]
    activation_ids: list[str]
    num_examples: list[int]
    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    arrivals: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # members' gradients still to be checked
    replies: dict[int, Any] = field(default_factory=dict)  # where each member's input gradient goes (ReplySink)
    dropped: set[int] = field(default_factory=set)
    grad_in: list[Future[torch.Tensor]] = field(default_factory=list)
    result: Future[Result] = field(default_factory=Promise)
    inputs: Any = None  # the trunk's input (hidden = ``leaf``), kept to recompute a rebased batch
    rng: Any = None  # the RNG state the forward ran with
    frozen: list[torch.Tensor] | None = None  # rebased: the weights the forward saw (the trunk has stepped)
    bringing: bool = False  # its gradients in host memory are to be brought early (splitfed.trunk.device.early)

    def __post_init__(self) -> None:
        self.grad_in = [Promise() for _ in self.clients]

    @property
    def complete(self) -> bool:
        """Every member sent its gradient or was dropped (and at least one sent)."""
        return bool(self.grads) and len(self.grads) + len(self.dropped) == len(self.clients)

    def output_gradient(self) -> tuple[torch.Tensor, list[float], int]:
        """The batched output's gradient: each member's weighted by its share of the received examples.

        Returns it with the weights and the number of examples it stands for.
        """
        assert self.output is not None
        total = sum(self.num_examples[i] for i in self.grads)
        weights = [self.num_examples[i] / total if i in self.grads else 0.0 for i in range(len(self.clients))]
        full = torch.zeros_like(self.output)
        for i, grad in self.grads.items():
            rows = full[self.packed.rows[i]]
            target = rows[:, : self.packed.lengths[i]] if full.dim() >= 3 else rows
            target.copy_(grad.to(full.dtype) * weights[i])
        return full, weights, total
