"""Every config switch that changes a supported family's forward splits exactly: logits and 5 training steps.

Each case is a tiny model whose config sets one switch (sliding windows under
their family's names, ``layer_types``, attention and rope scaling, biases, tied
embeddings, BERT's decoder mode and problem types, ...). Its split must give
the unsplit logits with and without padding, and after 5 AdamW steps on the
split model (trunk local) the weights must equal the unsplit model's.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from conftest import VOCAB, batch_for
from torch import nn

from splitfed.errors import UnsupportedModelError
from splitfed.split import attention_kinds, split_model

COMMON = {"num_hidden_layers": 4, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
          "vocab_size": VOCAB, "max_position_embeddings": 64}
SLIDE = "sliding_attention"
FULL = "full_attention"
STEPS = 5


@dataclass(frozen=True)
class Case:
    """One config switch of one family."""

    name: str
    arch: str
    overrides: dict[str, Any] = field(default_factory=dict)
    attns: tuple[str, ...] = ("sdpa",)
    labels: str = "default"  # "regression" or "multi-label" for BERT problem types
    kinds: tuple[str, ...] | None = None  # the mask kinds the unsplit forward uses, when the switch sets them

    def __str__(self) -> str:
        return self.name


CASES = [
    # GPT-2: attention scaling is fixed per layer at construction; it must survive the parts' re-indexing.
    Case("gpt2-no-scale-attn-weights", "gpt2", {"scale_attn_weights": False}, ("sdpa", "eager")),
    Case("gpt2-scale-by-inverse-layer-idx", "gpt2", {"scale_attn_by_inverse_layer_idx": True}, ("sdpa", "eager")),
    Case("gpt2-reorder-and-upcast", "gpt2",
         {"reorder_and_upcast_attn": True, "scale_attn_by_inverse_layer_idx": True}, ("eager",)),
    Case("gpt2-untied", "gpt2", {"tie_word_embeddings": False}),
    Case("gpt2-n-inner-relu", "gpt2", {"n_inner": 48, "activation_function": "relu"}),
    # Dropout: the parts run the same dropout calls in the same order, so a seeded step is still exact.
    Case("gpt2-dropout", "gpt2", {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}, ("sdpa", "eager")),
    # Llama: full causal mask whatever the config says; scaling and biases live in the modules.
    Case("llama-tied", "llama", {"tie_word_embeddings": True}),
    Case("llama-attention-mlp-bias", "llama", {"attention_bias": True, "mlp_bias": True}),
    Case("llama-head-dim", "llama", {"head_dim": 16}, ("sdpa", "eager")),
    Case("llama-rope-linear", "llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                            "rope_theta": 10000.0}}),
    Case("llama-rope-dynamic", "llama", {"max_position_embeddings": 8, "rope_parameters": {
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}),
    Case("llama-rope-yarn", "llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                          "original_max_position_embeddings": 16}}),
    Case("llama-rope-llama3", "llama", {"rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "rope_theta": 10000.0, "original_max_position_embeddings": 16}}),
    Case("llama-attention-dropout", "llama", {"attention_dropout": 0.2}, ("eager",)),
    Case("llama-ignores-layer-types", "llama", {"layer_types": [SLIDE, FULL, SLIDE, FULL], "sliding_window": 3},
         kinds=(FULL,) * 4),
    # Mistral: MistralModel picks the sliding-window mask from config.sliding_window alone.
    Case("mistral-sliding-window", "mistral", {"sliding_window": 3}, ("sdpa", "eager"), kinds=(SLIDE,) * 4),
    Case("mistral-no-window", "mistral", {"sliding_window": None}, kinds=(FULL,) * 4),
    Case("mistral-window-ignores-layer-types", "mistral",
         {"sliding_window": 3, "layer_types": [FULL, SLIDE, FULL, SLIDE]}, kinds=(SLIDE,) * 4),
    Case("mistral-head-dim-tied", "mistral", {"sliding_window": 3, "head_dim": 16, "tie_word_embeddings": True}),
    # Qwen2: use_sliding_window / sliding_window / max_window_layers build layer_types.
    Case("qwen2-window-from-layer-2", "qwen2", {"use_sliding_window": True, "sliding_window": 3,
                                                "max_window_layers": 2}, ("sdpa", "eager"),
         kinds=(FULL, FULL, SLIDE, SLIDE)),
    Case("qwen2-window-every-layer", "qwen2", {"use_sliding_window": True, "sliding_window": 3,
                                               "max_window_layers": 0}, kinds=(SLIDE,) * 4),
    Case("qwen2-window-off", "qwen2", {"use_sliding_window": False, "sliding_window": 3, "max_window_layers": 0},
         kinds=(FULL,) * 4),
    Case("qwen2-layer-types", "qwen2", {"use_sliding_window": True, "sliding_window": 3,
                                        "layer_types": [SLIDE, FULL, SLIDE, FULL]}, kinds=(SLIDE, FULL, SLIDE, FULL)),
    Case("qwen2-tied", "qwen2", {"tie_word_embeddings": True}),
    # Qwen3: the same switches, plus attention_bias.
    Case("qwen3-window-from-layer-1", "qwen3", {"use_sliding_window": True, "sliding_window": 3,
                                                "max_window_layers": 1}, ("sdpa", "eager"),
         kinds=(FULL, SLIDE, SLIDE, SLIDE)),
    Case("qwen3-layer-types", "qwen3", {"use_sliding_window": True, "sliding_window": 3,
                                        "layer_types": [FULL, SLIDE, SLIDE, FULL]}, kinds=(FULL, SLIDE, SLIDE, FULL)),
    Case("qwen3-attention-bias-tied", "qwen3", {"attention_bias": True, "tie_word_embeddings": True}),
    Case("qwen3-rope-linear", "qwen3", {"rope_parameters": {"rope_type": "linear", "factor": 4.0,
                                                            "rope_theta": 10000.0}}),
    # Gemma 1: scaled embeddings, no softcapping (set ones are ignored by its forward), bidirectional switch.
    Case("gemma-untied", "gemma", {"tie_word_embeddings": False}),
    Case("gemma-attention-bias", "gemma", {"attention_bias": True}),
    Case("gemma-head-dim", "gemma", {"head_dim": 16}, ("sdpa", "eager")),
    Case("gemma-bidirectional", "gemma", {"use_bidirectional_attention": True}, ("sdpa", "eager")),
    Case("gemma-ignores-softcapping", "gemma", {"final_logit_softcapping": 0.5, "attn_logit_softcapping": 0.5,
                                                "query_pre_attn_scalar": 4}),
    # Gemma 2: alternating sliding windows, attention and final-logit softcapping, query_pre_attn_scalar.
    Case("gemma2-defaults", "gemma2", {"sliding_window": 3}, ("eager",), kinds=(SLIDE, FULL, SLIDE, FULL)),
    Case("gemma2-softcapping", "gemma2", {"sliding_window": 3, "final_logit_softcapping": 0.5,
                                          "attn_logit_softcapping": 0.5}, ("eager",)),
    Case("gemma2-no-softcapping", "gemma2", {"sliding_window": 3, "final_logit_softcapping": None,
                                             "attn_logit_softcapping": None}, ("eager",)),
    Case("gemma2-query-pre-attn-scalar", "gemma2", {"sliding_window": 3, "query_pre_attn_scalar": 2}, ("eager",)),
    Case("gemma2-layer-types-untied", "gemma2", {"sliding_window": 3, "layer_types": [FULL, FULL, SLIDE, SLIDE],
                                                 "tie_word_embeddings": False}, ("eager",),
         kinds=(FULL, FULL, SLIDE, SLIDE)),
    # BERT: decoder mode (causal mask), problem types (the loss), feed-forward chunking, token types.
    Case("bert-decoder", "bert", {"is_decoder": True}, ("sdpa", "eager"), kinds=(FULL,) * 4),
    Case("bert-regression", "bert", {"num_labels": 1}, labels="regression"),
    Case("bert-multi-label", "bert", {"problem_type": "multi_label_classification"}, labels="multi-label"),
    Case("bert-dropout", "bert", {"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
                                  "classifier_dropout": 0.2}, ("eager",)),
    Case("bert-chunked-feed-forward", "bert", {"chunk_size_feed_forward": 4, "type_vocab_size": 3}),
]

PARAMS = [pytest.param(case, attn, id=f"{case}-{attn}") for case in CASES for attn in case.attns]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models run fastest on one thread


def build(case: Case, attn: str | None = None, seed: int = 0) -> nn.Module:
    """The tiny model of ``case`` (attention: the case's first), in train mode (dropout off unless the case sets it)."""
    import transformers as tf

    attn = attn or case.attns[0]

    torch.manual_seed(seed)
    if case.arch == "gpt2":
        cfg = tf.GPT2Config(**{"n_layer": 4, "n_embd": 32, "n_head": 4, "vocab_size": VOCAB, "n_positions": 64,
                               "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0,
                               "eos_token_id": 0, **case.overrides})
    elif case.arch == "bert":
        kwargs = {**COMMON, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
                  "classifier_dropout": 0.0, "num_labels": 3, **case.overrides}
        cfg = tf.BertConfig(**kwargs)
    else:
        cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config,
               "qwen3": tf.Qwen3Config, "gemma": tf.GemmaConfig, "gemma2": tf.Gemma2Config}[case.arch]
        extra: dict[str, Any] = {"num_key_value_heads": 2}
        if case.arch in ("qwen3", "gemma", "gemma2"):
            extra["head_dim"] = 8
        if case.arch in ("gemma", "gemma2"):
            extra.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
        cfg = cls(**{**COMMON, **extra, **case.overrides})
    cfg._attn_implementation = attn
    if case.arch == "bert":
        return tf.BertForSequenceClassification(cfg).train()
    return tf.AutoModelForCausalLM.from_config(cfg).train()


def batch(case: Case, padded: bool) -> dict[str, torch.Tensor]:
    """Inputs and labels for ``case`` (token types for BERT when the config has more than one)."""
    ids, mask, labels = batch_for(case.arch, padded=padded)
    out = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    g = torch.Generator().manual_seed(2)
    if case.labels == "regression":
        out["labels"] = torch.randn(ids.shape[0], generator=g)
    elif case.labels == "multi-label":
        out["labels"] = torch.randint(0, 2, (ids.shape[0], 3), generator=g).float()
    if case.arch == "bert" and case.overrides.get("type_vocab_size", 2) > 1:
        out["token_type_ids"] = (torch.arange(ids.shape[1]) >= ids.shape[1] // 2).long().expand_as(ids).clone()
    return out


def _compare(case: Case, want: torch.Tensor, got: torch.Tensor, mask: torch.Tensor, padded: bool) -> float:
    if padded and case.arch != "bert":  # outputs at decoder padding positions are not defined
        return (want - got)[mask.bool()].abs().max().item()
    return (want - got).abs().max().item()


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize(("case", "attn"), PARAMS)
def test_split_logits_equal_unsplit(case: Case, attn: str, padded: bool) -> None:
    # Prepare
    model = build(case, attn).eval()
    ref = copy.deepcopy(model)
    inputs = batch(case, padded)
    split = split_model(model, cuts=(1, 3))
    # Execute
    with torch.no_grad():
        want = ref(**inputs)
        got = split(**inputs)
    # Assert
    assert _compare(case, want.logits, got.logits, inputs["attention_mask"], padded) <= 1e-5
    assert abs(want.loss.item() - got.loss.item()) <= 1e-5


def packed_positions(batch: int, length: int) -> torch.Tensor:
    """Position ids of rows that each hold several sequences (packing), restarting at a different place per row."""
    rows = []
    for i in range(batch):
        cut = 3 + 2 * i
        rows.append(torch.cat([torch.arange(cut), torch.arange(length - cut)]))
    return torch.stack(rows)


@pytest.mark.parametrize("positions", ["default", "packed"])
@pytest.mark.parametrize(("case", "attn"), PARAMS)
def test_split_logits_equal_unsplit_without_a_padding_mask(case: Case, attn: str, positions: str) -> None:
    # Prepare: no attention mask, so positions decide the mask (packed rows attend within their own sequence;
    # a decoder's forward looks for packing only without its KV cache, as in training)
    model = build(case, attn).eval()
    ref = copy.deepcopy(model)
    inputs = batch(case, padded=False)
    del inputs["attention_mask"]
    if positions == "packed":
        inputs["position_ids"] = packed_positions(*inputs["input_ids"].shape)
    split = split_model(model, cuts=(1, 3))
    # Execute
    with torch.no_grad():
        want = ref(**inputs, **({} if case.arch == "bert" else {"use_cache": False}))
        got = split(**inputs)
    # Assert
    assert (want.logits - got.logits).abs().max().item() <= 1e-5
    assert abs(want.loss.item() - got.loss.item()) <= 1e-5


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mistral"])
def test_default_positions_stay_on_the_client_and_no_part_looks_for_packing(arch: str, monkeypatch) -> None:
    # Prepare: count the packed-sequence checks (each one's answer is read back from the device: a GPU stall)
    import transformers.masking_utils as masking

    checks: list[torch.Tensor] = []
    real = masking.find_packed_sequence_indices
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda pos: checks.append(pos) or real(pos))
    case = next(c for c in CASES if c.arch == arch)
    model = build(case).eval()
    split = split_model(model, cuts=(1, 3))
    ids = batch(case, padded=False)["input_ids"]
    # Execute
    with torch.no_grad():
        state = split.bottom(ids)
        split(input_ids=ids)
        defaulted = len(checks)
        split(input_ids=ids, position_ids=torch.arange(ids.shape[1]).expand_as(ids))
    # Assert: default positions do not cross the cut and cost no check; explicit ones are checked in every part
    assert state.position_ids is None
    assert "position_ids" not in state.tensors()
    assert defaulted == 0
    assert len(checks) >= 3


@pytest.mark.parametrize(("case", "attn"), PARAMS)
def test_five_training_steps_equal_unsplit(case: Case, attn: str) -> None:
    # Prepare
    model = build(case, attn)
    ref = copy.deepcopy(model)
    inputs = batch(case, padded=True)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    split = split_model(model, cuts=(1, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    # Execute. The unsplit model runs without its KV cache (on by default): the cache copies keys and values,
    # which changes the rounding of eager attention's backward (by ~1e-8, then amplified by AdamW).
    for step in range(STEPS):
        for net, optimizer, extra in ((split, opt, {}), (ref, ref_opt, {"use_cache": False})):
            torch.manual_seed(step)  # the same dropout masks on both sides
            net(**inputs, **extra).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    # Assert: every weight (tied ones included) moved, and moved exactly as in the unsplit model
    want, got = ref.state_dict(), model.state_dict()
    assert want.keys() == got.keys()
    diff = max((want[k].float() - got[k].float()).abs().max().item() for k in want)
    assert diff <= 1e-6
    assert all(not torch.equal(got[k], start[k]) for k in got if k.endswith("weight"))


@pytest.mark.parametrize("case", [c for c in CASES if c.kinds is not None], ids=str)
def test_mask_kinds_follow_the_family_forward(case: Case) -> None:
    model = build(case)
    assert attention_kinds(model.config) == list(case.kinds)
    # Each part sees its own slice of the kinds.
    split = split_model(model, cuts=(1, 3))
    parts = [attention_kinds(p.config) for p in (split.bottom, split.trunk, split.top)]
    assert parts == [list(case.kinds[:1]), list(case.kinds[1:3]), list(case.kinds[3:])]


def test_sequential_with_batchnorm_and_dropout_trains_exactly() -> None:
    # Prepare: running statistics and seeded dropout masks must follow the unsplit order
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 8),
                          nn.ReLU(), nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    split = split_model(model, cuts=(2, 5))
    x, y = torch.randn(10, 6), torch.randint(0, 3, (10,))
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=0.01) for m in (model, ref))
    # Execute
    for step in range(STEPS):
        torch.manual_seed(step)
        split(x, labels=y).loss.backward()
        torch.manual_seed(step)
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    # Assert: weights and BatchNorm running statistics
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), atol=1e-6), name


def test_heterogeneous_config_is_refused() -> None:
    model = build(Case("llama", "llama"))
    if not hasattr(type(model.config), "is_heterogeneous"):
        pytest.skip("this transformers release has no per-layer configs (its models ignore per_layer_config)")
    model.config.per_layer_config = {0: {"intermediate_size": 48}}
    with pytest.raises(UnsupportedModelError, match="per_layer_config"):
        split_model(model, cuts=(1, 3))


@pytest.mark.parametrize("name", ["mistral-sliding-window", "qwen2-window-from-layer-2", "qwen3-window-from-layer-1",
                                  "gemma2-softcapping"])
def test_split_generation_with_sliding_windows_matches_generate(name: str) -> None:
    # Prepare: weights spread wide enough that greedy decoding does not repeat one token; prompt and
    # output (7 + 10 tokens) run well past the window of 3, so the sliding KV caches drop positions.
    from splitfed.client.generation import generate

    case = next(c for c in CASES if c.name == name)
    model = build(case).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    ref = copy.deepcopy(model)
    ids, mask, _ = batch_for(case.arch, batch=3, length=7, padded=True)
    tokens = {"eos_token_id": ref.generation_config.eos_token_id, "pad_token_id": 0}
    # Execute
    want = ref.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10, **tokens)
    parts = split_model(model, cuts=(1, 3))
    got = generate(parts.bottom, parts.trunk, parts.top, ids, mask, max_new_tokens=10, **tokens)
    # Assert
    assert torch.equal(got, want), (got, want)
    assert len(set(got[0, 7:].tolist())) > 1
