"""A split model computes exactly what the unsplit model computes: forward outputs and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ARCHS, batch_for, tiny_cnn, tiny_model

from splitfed.errors import SplitError, UnsupportedModelError
from splitfed.split import load_unique_state, split_model, unique_state


def _logits(model, arch, ids, mask):
    out = model(input_ids=ids, attention_mask=mask)
    return out.logits


def _valid(arch: str, mask: torch.Tensor | None) -> torch.Tensor | None:
    """Positions whose outputs are defined (padding positions of decoders are not compared)."""
    if mask is None or arch == "bert":
        return None
    return mask.bool()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("padded", [False, True])
def test_split_forward_equals_unsplit(arch: str, attn: str, padded: bool) -> None:
    # Prepare
    model = tiny_model(arch, attn=attn)
    ref = copy.deepcopy(model)
    ids, mask, _ = batch_for(arch, padded=padded)
    split = split_model(model, cuts=(1, 3))
    # Execute
    with torch.no_grad():
        want = _logits(ref, arch, ids, mask)
        got = split(ids, attention_mask=mask).logits
    # Assert
    valid = _valid(arch, mask if padded else None)
    diff = (want - got).abs() if valid is None else (want - got)[valid].abs()
    assert diff.max().item() <= 1e-6


@pytest.mark.parametrize("cuts", [(0, 1), (0, 4), (2, 4), (3, 4), (1, 2)])
def test_every_cut_position_is_exact(cuts: tuple[int, int]) -> None:
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    ids, mask, _ = batch_for("llama", padded=True)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).logits
        got = split_model(model, cuts=cuts)(ids, attention_mask=mask).logits
    assert (want - got)[mask.bool()].abs().max().item() <= 1e-6


@pytest.mark.parametrize("arch", ARCHS)
def test_split_gradients_equal_unsplit(arch: str) -> None:
    # Prepare
    model = tiny_model(arch).train()
    ref = copy.deepcopy(model)
    ids, mask, labels = batch_for(arch, padded=True)
    split = split_model(model, cuts=(1, 3))
    # Execute
    ref(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    split(ids, attention_mask=mask, labels=labels).loss.backward()
    # Assert: every parameter (tied embeddings included) has the unsplit gradient
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.allclose(p.grad, ref_grads[name], atol=1e-6, rtol=1e-5), name


@pytest.mark.parametrize("arch", ["gpt2", "gemma"])
def test_tied_embeddings_stay_tied_and_sum_gradients(arch: str) -> None:
    model = tiny_model(arch).train()
    split = split_model(model, cuts=(1, 3))
    assert split.bottom.embed is not None
    embed = split.bottom.embed.wte if arch == "gpt2" else split.bottom.embed
    assert split.top.head.weight is embed.weight
    ids, mask, labels = batch_for(arch)
    split(ids, attention_mask=mask, labels=labels).loss.backward()
    # One parameter object, one gradient: input-side and output-side contributions summed.
    assert embed.weight.grad is not None and split.top.head.weight.grad is embed.weight.grad
    # Exchanged once.
    state = unique_state(split.client_modules())
    assert sum(1 for t in state.values() if t.data_ptr() == embed.weight.data_ptr()) == 1


def test_cnn_split_forward_and_gradients() -> None:
    model = tiny_cnn().train()
    ref = copy.deepcopy(model)
    x = torch.randn(5, 1, 28, 28)
    y = torch.randint(0, 10, (5,))
    split = split_model(model, cuts=(3, 6))
    out = split(x, labels=y)
    ref_logits = ref(x)
    assert (out.logits - ref_logits).abs().max().item() <= 1e-6
    out.loss.backward()
    torch.nn.functional.cross_entropy(ref_logits, y).backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-7), n


def test_part_keys_map_to_full_model_keys() -> None:
    model = tiny_model("llama")
    full = model.state_dict()
    split = split_model(model, cuts=(1, 3))
    for part in (split.bottom, split.trunk, split.top):
        for key, tensor in part.state_dict().items():
            full_key = part.spec.full_key(key)
            assert torch.equal(full[full_key], tensor), (part.role, key, full_key)
            assert part.spec.part_key(full_key) == key
    assert split.trunk.spec.part_key("model.embed_tokens.weight") is None
    assert split.trunk.spec.full_key("layers.0.self_attn.q_proj.weight") == "model.layers.1.self_attn.q_proj.weight"


def test_unique_state_roundtrip() -> None:
    a = split_model(tiny_model("gpt2", seed=1), cuts=(1, 3)).client_modules()
    b = split_model(tiny_model("gpt2", seed=2), cuts=(1, 3)).client_modules()
    load_unique_state(b, unique_state(a))
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


@pytest.mark.parametrize("cuts", [(2, 2), (3, 1), (-1, 2), (0, 5), (1,)])
def test_bad_cuts_are_refused_with_a_message(cuts) -> None:
    with pytest.raises(SplitError, match="cuts"):
        split_model(tiny_model("gpt2"), cuts=cuts)


def test_unsupported_model_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="supported"):
        split_model(torch.nn.Linear(3, 3), cuts=(0, 1))
