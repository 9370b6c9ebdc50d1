"""Five optimizer steps of a 1-client split run over the real gRPC channel equal five unsplit steps."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ARCHS, batch_for, tiny_cnn, tiny_config, tiny_model

from splitfed.channel.client.remote import RemoteTrunk
from splitfed.optim import make_optimizer
from splitfed.split import SplitModel, split_model

STEPS = 5


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)


def _train_pair(model, inputs, mask, labels, optimizer: str, trunk_server, lr: float = 0.05,
                shared_memory: str = "off") -> tuple[float, float]:
    ref = copy.deepcopy(model)
    split = split_model(model, cuts=(1, 3) if not isinstance(model, torch.nn.Sequential) else (3, 6))
    server = trunk_server(split.trunk, optimizer=optimizer, lr=lr)
    remote = RemoteTrunk(server.address, insecure=True, shared_memory=shared_memory)
    client = SplitModel(split.bottom, remote, split.top, task=split.task)
    client_opt = make_optimizer(optimizer, split.client_modules().parameters(), lr)
    ref_opt = make_optimizer(optimizer, ref.parameters(), lr)
    losses = []
    for _ in range(STEPS):
        out = client(inputs, attention_mask=mask, labels=labels)
        out.loss.backward()
        client_opt.step()
        client_opt.zero_grad()
        if isinstance(ref, torch.nn.Sequential):
            ref_loss = torch.nn.functional.cross_entropy(ref(inputs), labels)
        else:
            ref_loss = ref(input_ids=inputs, attention_mask=mask, labels=labels).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((out.loss.item(), ref_loss.item()))
    shared_calls = remote.client.shared.calls
    remote.close()
    if shared_memory == "on":  # every Forward and Backward carried its tensor through the region
        assert shared_calls == 2 * STEPS
    assert server.runtime.version == STEPS
    assert remote.outcomes == {"APPLIED": STEPS}
    return _max_diff(model, ref), abs(losses[-1][0] - losses[-1][1])


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("arch", ARCHS)
def test_five_steps_over_grpc_equal_unsplit(arch: str, optimizer: str, trunk_server) -> None:
    model = tiny_model(arch).train()
    ids, mask, labels = batch_for(arch, padded=True)
    weight_diff, loss_diff = _train_pair(model, ids, mask, labels, optimizer, trunk_server)
    assert weight_diff <= 1e-6
    assert loss_diff <= 1e-6


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2", "bert", "cnn"])
def test_five_steps_through_shared_memory_equal_unsplit(arch: str, optimizer: str, trunk_server,
                                                        monkeypatch) -> None:
    from splitfed.channel.transports.shm import lane as shared

    monkeypatch.setattr(shared, "MIN_REGION_TENSOR_BYTES", 1)  # the tiny models' activations are small
    if arch == "cnn":
        model = tiny_cnn().train()
        torch.manual_seed(3)
        inputs, mask, labels = torch.randn(4, 1, 28, 28), None, torch.randint(0, 10, (4,))
    else:
        model = tiny_model(arch).train()
        inputs, mask, labels = batch_for(arch, padded=True)
    weight_diff, loss_diff = _train_pair(model, inputs, mask, labels, optimizer, trunk_server, shared_memory="on")
    assert weight_diff <= 1e-6
    assert loss_diff <= 1e-6


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_mistral_sliding_window_five_steps_over_grpc_equal_unsplit(optimizer: str, trunk_server) -> None:
    # A window of 3 over 12 tokens: every part must build the sliding-window mask, as MistralModel does.
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("mistral")
    cfg.sliding_window = 3
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).train()
    ids, mask, labels = batch_for("mistral", padded=True)
    weight_diff, loss_diff = _train_pair(model, ids, mask, labels, optimizer, trunk_server)
    assert weight_diff <= 1e-6
    assert loss_diff <= 1e-6


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_cnn_five_steps_over_grpc_equal_unsplit(optimizer: str, trunk_server) -> None:
    model = tiny_cnn().train()
    torch.manual_seed(3)
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    weight_diff, loss_diff = _train_pair(model, x, None, y, optimizer, trunk_server)
    assert weight_diff <= 1e-6
    assert loss_diff <= 1e-6
