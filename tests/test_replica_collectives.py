"""A sync step's gradient all-reduce over trunk replicas (``reduce_gradients``), checked bit for bit against the
plain sum it stands for: two replicas' buffers (the second one's captured, then added by a stand-in for the
all-reduce), weighted contributions, parameters without a gradient on one replica or on all, and abstentions."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from splitfed.trunk.replicas import collectives as replica_collectives
from splitfed.trunk.aggregation.contributions import Contribution
from splitfed.trunk.replicas.collectives import _runs, reduce_gradients

SHAPES = ((3, 4), (5,), (2, 2, 2), (7,), (4, 3))


def _grads(seed: int, missing: tuple[int, ...] = ()) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    return [None if i in missing else torch.randn(*shape, generator=g) for i, shape in enumerate(SHAPES)]


def _runtime() -> Any:
    return types.SimpleNamespace(_trainable=[torch.nn.Parameter(torch.zeros(*shape)) for shape in SHAPES])


def _over_two_replicas(monkeypatch: pytest.MonkeyPatch, mine: list[Contribution],
                       theirs: list[Contribution]) -> list[torch.Tensor | None] | None:
    """``mine``'s update when the other replica contributes ``theirs``: its buffer is captured first, then the
    all-reduce (a sum over ranks) adds it to this replica's."""
    captured: list[torch.Tensor] = []
    monkeypatch.setattr(replica_collectives.dist, "all_reduce", lambda flat: captured.append(flat.clone()))
    reduce_gradients(_runtime(), theirs)
    monkeypatch.setattr(replica_collectives.dist, "all_reduce", lambda flat: flat.add_(captured[0]))
    return reduce_gradients(_runtime(), mine)


def test_the_update_is_the_example_weighted_sum_over_both_replicas_bit_for_bit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: parameter 1 has a gradient on neither replica, parameter 3 only on the other one.
    mine = [Contribution("a", 0, _grads(1, missing=(1, 3)), num_examples=3, weight=0.5),
            Contribution("b", 0, _grads(2, missing=(1, 3)), num_examples=5),
            Contribution("refused", 0, None, num_examples=2)]  # an abstention counts no examples here
    theirs = [Contribution("c", 0, _grads(3, missing=(1,)), num_examples=4, weight=2.0)]
    # Execute
    update = _over_two_replicas(monkeypatch, mine, theirs)
    # Assert: each replica sums its own weighted gradients from zero, the sum crosses, and is divided by every
    # example of both replicas.
    assert update is not None
    total = 3 + 5 + 4
    for i, shape in enumerate(SHAPES):
        if i == 1:
            assert update[i] is None
            continue
        own, other = torch.zeros(shape), torch.zeros(shape)
        for c in mine[:2]:
            if c.grads[i] is not None:  # type: ignore[index]
                own.add_(c.grads[i], alpha=c.weight * c.num_examples)  # type: ignore[index, arg-type]
        other.add_(theirs[0].grads[i], alpha=2.0 * 4)  # type: ignore[index, arg-type]
        assert torch.equal(update[i], (own + other) / total), i  # type: ignore[arg-type]


def test_no_examples_on_any_replica_is_no_update(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _over_two_replicas(monkeypatch, [Contribution("a", 0, None, num_examples=3)], []) is None


def test_runs_of_consecutive_indices() -> None:
    assert _runs([]) == [] and _runs([4]) == [(4, 5)]
    assert _runs([0, 1, 2, 5, 7, 8]) == [(0, 3), (5, 6), (7, 9)]
