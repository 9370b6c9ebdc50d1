"""Activation checkpointing on the trunk: the same gradients and weights, a fraction of the saved bytes."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_model

from splitfed.split import CutState, split_model
from splitfed.trunk.aggregation.modes import make_aggregator
from splitfed.trunk.compute.runtime import TrunkRuntime


def _runtime(arch: str, checkpointing: bool, mode: str = "async") -> tuple[TrunkRuntime, torch.nn.Module]:
    model = tiny_model(arch, layers=4).train()
    for m in model.modules():  # dropout on: the recompute must replay the same masks
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.1
    trunk = split_model(model, cuts=(1, 3)).trunk
    rt = TrunkRuntime(trunk, torch.optim.SGD(trunk.parameters(), lr=0.1),
                      aggregator=make_aggregator(mode, max_staleness=4), checkpointing=checkpointing)
    return rt, trunk


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_checkpointed_trunk_gives_the_same_gradients_and_weights(arch: str) -> None:
    g = torch.Generator().manual_seed(0)
    states = [CutState(torch.randn(2, 12, 32, generator=g)) for _ in range(4)]
    grads = [torch.randn(2, 12, 32, generator=g) for _ in range(4)]
    results = {}
    for checkpointing in (False, True):
        torch.manual_seed(1)
        rt, trunk = _runtime(arch, checkpointing)
        outs, grad_ins, held = [], [], []
        # Two clients interleaved: "b" forwards before "a"'s step, so its backward is also a stale one.
        for step in range(2):
            torch.manual_seed(10 + step)
            out_a, _ = rt.forward("a", f"a{step}", states[2 * step], train=True)
            out_b, _ = rt.forward("b", f"b{step}", states[2 * step + 1], train=True)
            held.append(rt.store.forward_bytes)
            grad_ins.append(rt.backward("a", f"a{step}", grads[2 * step]).grad_in)
            grad_ins.append(rt.backward("b", f"b{step}", grads[2 * step + 1]).grad_in)
            outs += [out_a, out_b]
        results[checkpointing] = (outs, grad_ins, copy.deepcopy(trunk.state_dict()), held, rt.stats["recomputed"])
    plain, ckpt = results[False], results[True]
    for a, b in zip(plain[0] + plain[1], ckpt[0] + ckpt[1]):
        assert torch.allclose(a, b, atol=1e-6)
    for key, value in plain[2].items():
        assert torch.allclose(value, ckpt[2][key], atol=1e-6), key
    assert max(ckpt[3]) * 4 < min(plain[3])  # inputs and outputs only, not every layer's activations
    # Every checkpointed backward recomputes; plain only the first stale one: once both clients are in the step
    # group, their forwards run on their version's copy of the weights and keep their graph (trunk.versions).
    assert ckpt[4] == 4 and plain[4] == 1
