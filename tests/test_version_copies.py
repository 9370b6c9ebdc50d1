"""Async forwards on their version's copy of the weights (splitfed.trunk.compute.versions): the gradients, outputs and
weights of forwards whose backward comes after other clients' steps equal those of the rebase-and-recompute path,
and every frozen copy goes once no forward needs it."""

from __future__ import annotations

import torch
from conftest import tiny_model

from splitfed.split import CutState, split_model
from splitfed.trunk.compute import versions
from splitfed.trunk.aggregation.modes import make_aggregator
from splitfed.trunk.compute.runtime import TrunkRuntime
from splitfed.trunk.compute.store import StoreLimits

CLIENTS = ("a", "b", "c")


def _runtime(dropout: float, limits: StoreLimits = StoreLimits()) -> tuple[TrunkRuntime, torch.nn.Module]:
    torch.manual_seed(0)
    split = split_model(tiny_model("gpt2").train(), cuts=(1, 3))
    for m in split.trunk.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = dropout
    rt = TrunkRuntime(split.trunk, torch.optim.SGD(split.trunk.parameters(), lr=0.5),
                      aggregator=make_aggregator("async", max_staleness=8), limits=limits)
    return rt, split.trunk


def _state(i: int) -> CutState:
    g = torch.Generator().manual_seed(100 + i)
    return CutState(torch.randn(2, 6, 32, generator=g))


def _run(dropout: float = 0.0) -> tuple[TrunkRuntime, torch.nn.Module, list[torch.Tensor]]:
    """Each client steps once on its own (so all are members), then all three forward before any backward, and
    the backwards come in the reverse order: c's makes a step under a's and b's forwards, b's another under a's."""
    rt, trunk = _runtime(dropout)
    seen: list[torch.Tensor] = []
    torch.manual_seed(7)  # the dropout masks: the same draws in both runs
    for i, c in enumerate(CLIENTS):
        out, _ = rt.forward(c, f"{c}-warm", _state(i), train=True)
        seen += [out, rt.backward(c, f"{c}-warm", torch.cos(out) / 50).grad_in]
    outs = {}
    for i, c in enumerate(CLIENTS):
        outs[c], version = rt.forward(c, f"{c}-1", _state(10 + i), train=True)
        assert version == 3
        seen.append(outs[c])
    for c in reversed(CLIENTS):
        done = rt.backward(c, f"{c}-1", torch.sin(outs[c] * 3) / 50)
        assert done.result.staleness == {"c": 0, "b": 1, "a": 2}[c]
        seen.append(done.grad_in)
    assert rt.version == 6
    return rt, trunk, seen


def _rebasing(monkeypatch) -> None:
    """The path before version copies: async forwards on the live weights, rebased at each step."""
    monkeypatch.setattr(versions, "VERSIONED_MODES", frozenset())


def test_stale_async_gradients_equal_the_rebased_recomputed_ones_without_a_second_forward(monkeypatch) -> None:
    """With version copies no forward is rebased or recomputed (c's warm-up forward and the three later ones ran
    on copies of versions 2 and 3), and every output, input gradient and weight after the six steps equals, bit
    for bit, what rebasing and recomputing gives (dropout on: the same masks)."""
    rt, trunk, seen = _run(dropout=0.2)
    assert rt.stats["recomputed"] == 0 and rt.stats["rebased"] == 0 and rt._copies.made == 2
    with monkeypatch.context() as m:
        _rebasing(m)
        ref_rt, ref_trunk, ref_seen = _run(dropout=0.2)
    assert ref_rt.stats["recomputed"] == 2 and ref_rt.stats["rebased"] == 2
    for x, y in zip(seen, ref_seen, strict=True):
        assert torch.equal(x, y)
    for (name, p), q in zip(trunk.state_dict().items(), ref_trunk.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_a_stale_gradient_is_that_of_the_weights_its_forward_saw() -> None:
    """a's forward ran at version 3 and its backward after two steps: its input gradient and the update it makes
    are those of the version-3 weights, computed here from a copy of the trunk taken then."""
    import copy

    rt, trunk = _runtime(0.0)
    for i, c in enumerate(CLIENTS):
        out, _ = rt.forward(c, f"{c}-warm", _state(i), train=True)
        rt.backward(c, f"{c}-warm", torch.cos(out) / 50)
    at_3 = copy.deepcopy(trunk)
    outs = {c: rt.forward(c, f"{c}-1", _state(10 + i), train=True)[0] for i, c in enumerate(CLIENTS)}
    for c in ("c", "b"):
        rt.backward(c, f"{c}-1", torch.sin(outs[c] * 3) / 50)
    at_5 = copy.deepcopy(trunk)
    got = rt.backward("a", "a-1", torch.sin(outs["a"] * 3) / 50)
    leaf = _state(10).hidden.clone().requires_grad_(True)
    params = list(at_3.parameters())
    want = torch.autograd.grad(at_3(CutState(leaf)).hidden, [leaf] + params, torch.sin(outs["a"] * 3) / 50)
    assert torch.allclose(got.grad_in, want[0], atol=1e-6) and got.result.staleness == 2
    for p, before, g in zip(trunk.parameters(), at_5.parameters(), want[1:], strict=True):
        assert torch.allclose(p, before - 0.5 * g, atol=1e-6)


def test_copies_go_once_no_forward_needs_them() -> None:
    """After the backwards, no frozen copy is held; with forwards outstanding, only their versions' copies."""
    rt, _, _ = _run()
    assert rt.store.frozen_copies == 0 and rt.store.frozen_bytes == 0 and len(rt.store) == 0
    out, _ = rt.forward("a", "a-2", _state(20), train=True)  # version 6's copy, one user
    rt.forward("b", "b-2", _state(21), train=True)
    assert rt.store.frozen_copies == 1
    rt.backward("a", "a-2", torch.ones_like(out))  # a step: version 6's copy stays for b's forward
    assert rt.store.frozen_copies == 1 and rt.store.find("b-2").frozen.version == 6
    rt.forget("b", "b-2")
    assert rt.store.frozen_copies == 0 and rt.store.frozen_bytes == 0


def test_a_copy_no_forward_used_goes_at_the_step(monkeypatch) -> None:
    """A forward that fails after its version's copy was made (the device out of memory) leaves the copy unused:
    the next step lets it go, whether or not another forward comes first."""
    import pytest

    from splitfed.errors import TrunkBusyError

    def out_of_memory(*args, **kwargs):
        raise TrunkBusyError("the trunk ran out of device memory in a forward")

    rt, _, _ = _run()
    out_b, _ = rt.forward("b", "b-2", _state(20), train=True)  # version 6's copy
    out_c, _ = rt.forward("c", "c-2", _state(21), train=True)
    rt.backward("c", "c-2", torch.cos(out_c) / 50)  # step to version 7; b still uses version 6's copy
    with monkeypatch.context() as m, pytest.raises(TrunkBusyError):
        m.setattr(rt, "traced_forward", out_of_memory)
        rt.forward("a", "a-2", _state(22), train=True)  # version 7's copy, then the forward fails
    assert rt.store.frozen_copies == 2
    rt.backward("b", "b-2", torch.cos(out_b) / 50)  # version 6's copy goes with b's forward; the step, 7's
    assert rt.version == 8 and rt.store.frozen_copies == 0 and rt.store.frozen_bytes == 0


def test_at_most_max_frozen_copies_evicting_the_forwards_on_the_oldest() -> None:
    """Forwards of four versions with ``max_frozen=2``: the oldest versions' forwards are evicted, the newest two
    kept."""
    from splitfed.errors import ActivationNotFoundError

    rt, _ = _runtime(0.0, StoreLimits(max_frozen=2))
    for i, c in enumerate(CLIENTS):
        out, _ = rt.forward(c, f"{c}-warm", _state(i), train=True)
        rt.backward(c, f"{c}-warm", torch.cos(out) / 50)
    for k in range(4):  # b forwards at versions 3, 4, 5 and 6; c steps the trunk in between
        rt.forward("b", f"b-{k}", _state(30 + k), train=True)
        out, _ = rt.forward("c", f"c-{k}", _state(40 + k), train=True)
        rt.backward("c", f"c-{k}", torch.cos(out) / 50)
    assert rt.store.frozen_copies == 2 and rt.store.evicted == 2
    assert [rt.store.find(f"b-{k}") is None for k in range(4)] == [True, True, False, False]
    try:
        rt.backward("b", "b-0", torch.ones(2, 6, 32))
    except ActivationNotFoundError:
        pass
    else:
        raise AssertionError("an evicted forward's backward must be refused")
