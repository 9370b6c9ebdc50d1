"""The end-of-round merge of heterogeneous cuts: one global version of every block.

With client cuts (:mod:`splitfed.models.hetero`) a block may have been trained by
several holders in one round: clients that hold it in their bottom or top, and
the trunk when some client had the trunk run it. Its global version is the
example-weighted average of every copy that trained it::

    w_k = (sum_{c holds k} n_c w_{c,k} + N_k w_{trunk,k}) / (sum_{c holds k} n_c + N_k)

where ``N_k`` is the examples of the clients the trunk ran block ``k`` for (the
trunk's copy stands for their data; it is absent when ``N_k = 0``). Every holder
starts the next round from ``w_k``.

The server reaches this through the configured Flower strategy: each client's
reply is *completed* (:func:`complete_state`) with the trunk's copy of the
blocks ``[a, b)`` the trunk ran for it, so every reply is a whole model and the
strategy aggregates as it would without a split. With FedAvg, averaging the
completed replies by examples is exactly the formula above (tested against
:func:`merge_copies`); FedProx, FedAdam, FedMedian, Krum... apply their own rule
to the same whole-model replies. Pure torch: no Flower here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from splitfed.errors import SplitError

_NUMBER = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple[object, ...]:
    """Sort key that orders ``layers.10`` after ``layers.9`` (the unsplit model's block order)."""
    return tuple(int(p) if p.isdigit() else p for p in _NUMBER.split(name))


@dataclass(frozen=True)
class Copy:
    """One holder's copy of some blocks after a round: its tensors (unsplit names) and its examples."""

    state: Mapping[str, torch.Tensor]
    num_examples: float


def merge_copies(copies: Sequence[Copy]) -> dict[str, torch.Tensor]:
    """Per tensor, the example-weighted average over the copies that hold it (the rule of this module)."""
    totals: dict[str, float] = {}
    for c in copies:
        if c.num_examples <= 0:
            raise SplitError(f"a copy must stand for at least one example, got {c.num_examples}")
        for key in c.state:
            totals[key] = totals.get(key, 0.0) + float(c.num_examples)
    out: dict[str, torch.Tensor] = {}
    for c in copies:
        for key, value in c.state.items():
            term = value.detach().double() * (float(c.num_examples) / totals[key])
            out[key] = term if key not in out else out[key] + term
    first = {k: v for c in reversed(copies) for k, v in c.state.items()}
    return {k: out[k].to(first[k].dtype) for k in sorted(out, key=natural_key)}


def trunk_copy_examples(cuts: Sequence[tuple[int, int]], examples: Sequence[float], block: int) -> float:
    """``N_k``: the examples of the clients (cut ``(a, b)``, ``examples``) the trunk ran ``block`` for."""
    return float(sum(n for (a, b), n in zip(cuts, examples, strict=True) if a <= block < b))


def complete_state(client: Mapping[str, torch.Tensor], trunk_blocks: Mapping[str, torch.Tensor]
                   ) -> dict[str, torch.Tensor]:
    """A client's reply as a whole model: its own parts plus the trunk's copy of the blocks it ran for it.

    Keys come out in the unsplit model's order, the same for every client, so strategies that flatten
    replies (Krum, FedMedian) line them up. Raises :class:`SplitError` if both hold a tensor.
    """
    both = sorted(set(client) & set(trunk_blocks))
    if both:
        raise SplitError(f"client and trunk both hold {both[:3]}: a client's cut (a, b) must leave blocks [a, b) "
                         "to the trunk; check its cuts against the server's client-cuts")
    merged = {**client, **trunk_blocks}
    return {k: merged[k] for k in sorted(merged, key=natural_key)}


__all__ = ["Copy", "complete_state", "merge_copies", "natural_key", "trunk_copy_examples"]
