"""Mixed precision: bf16 autocast on both sides with fp32 master weights, half-precision wire, torch.compile."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import batch_for, tiny_model

from splitfed.channel.client.remote import RemoteTrunk
from splitfed.data import Batch
from splitfed.split import SplitModel, split_model
from splitfed.client.training import train
from splitfed.trunk.compute.runtime import TrunkRuntime


def _run(trunk_server, wire: str, autocast: torch.dtype | None, steps: int = 6, seen: dict | None = None):
    model = tiny_model("llama").train()
    split = split_model(model, cuts=(1, 3))
    runtime = TrunkRuntime(split.trunk, torch.optim.AdamW(split.trunk.parameters(), lr=3e-3),
                           autocast_dtype=autocast)
    if seen is not None:  # what reaches the trunk, and what the trunk computes in
        prepare = runtime._prepare
        runtime._prepare = lambda state, train: (seen.setdefault("received", set()).add(state.hidden.dtype),
                                                 prepare(state, train))[1]
        linear = next(m for m in split.trunk.modules() if isinstance(m, torch.nn.Linear))
        linear.register_forward_hook(lambda m, i, o: seen.setdefault("computed", set()).add(o.dtype))
    server = trunk_server(runtime)
    remote = RemoteTrunk(server.address, insecure=True, wire_dtype=wire)
    client = SplitModel(split.bottom, remote, split.top, task="causal-lm")
    ids, mask, labels = batch_for("llama", batch=4, length=16)
    opt = torch.optim.AdamW(split.client_modules().parameters(), lr=3e-3)
    data = iter([Batch(ids, mask, labels) for _ in range(steps)])
    report = train(client, opt, data, steps, autocast_dtype=autocast)
    return model, report, remote


@pytest.mark.parametrize("wire, autocast", [("bf16", None), ("fp16", None), ("bf16", torch.bfloat16)])
def test_half_precision_training_tracks_fp32(trunk_server, wire: str, autocast) -> None:
    initial = copy.deepcopy(tiny_model("llama").state_dict())
    ref_model, ref, ref_remote = _run(trunk_server, "fp32", None)
    seen: dict = {}
    model, rep, remote = _run(trunk_server, wire, autocast, seen=seen)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights on every side
    assert abs(rep.loss - ref.loss) < 0.05 * ref.loss
    assert rep.bytes_sent < 0.75 * ref.bytes_sent  # hidden states and gradients travel in 2 bytes
    assert remote.outcomes == {"APPLIED": 6}
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[wire]
    assert seen["received"] == {half}  # the cut crossed in 2 bytes
    assert seen["computed"] == {torch.bfloat16 if autocast is not None else torch.float32}  # the trunk's matmuls
    # Every part trained, the trunk included, and the updates track the fp32 run's at half-precision tolerance.
    trunk_keys = [k for k in initial if k.startswith("model.layers.1.") or k.startswith("model.layers.2.")]
    assert trunk_keys and all(not torch.equal(model.state_dict()[k], initial[k]) for k in trunk_keys)
    ref_state, state = ref_model.state_dict(), model.state_dict()
    for key, w0 in initial.items():
        want, got = ref_state[key] - w0, state[key] - w0
        if want.norm() > 0:
            assert (got - want).norm() <= 0.25 * want.norm(), key


@pytest.mark.slow
def test_torch_compile_parts_give_the_same_outputs() -> None:
    model = tiny_model("gpt2").eval()
    eager = split_model(copy.deepcopy(model), cuts=(1, 3))
    split = split_model(model, cuts=(1, 3))
    compiled = SplitModel(torch.compile(split.bottom), torch.compile(split.trunk), torch.compile(split.top),
                          task="causal-lm")
    ids, mask, _ = batch_for("gpt2")
    with torch.no_grad():
        assert torch.allclose(compiled(ids, attention_mask=mask).logits, eager(ids, attention_mask=mask).logits,
                              atol=1e-5)
