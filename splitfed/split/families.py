"""What each supported family's Hugging Face forward reads from its config, so every part builds the same.

A split is exact only when each part builds the masks and embeddings that the
unsplit model's forward builds. The families differ in which config fields pick
them, and these rules mirror the installed transformers 5.x modeling files:

- Mistral: one mask for every layer, the sliding-window mask when
  ``config.sliding_window`` is set and the full causal mask when it is ``None``;
  a ``layer_types`` attribute, if present, is ignored by ``MistralModel``.
- Qwen2 and Qwen3: per layer, from ``config.layer_types`` (built from
  ``use_sliding_window``, ``sliding_window`` and ``max_window_layers``).
- Gemma 2: per layer, from ``config.layer_types`` (sliding every other layer
  by default); its head soft-caps the logits by ``final_logit_softcapping``.
- Llama, Gemma and GPT-2: the full causal mask for every layer, whatever else
  the config holds.
- BERT: the bidirectional mask, or the causal mask when ``config.is_decoder``.

Everything else (attention scaling, ``query_pre_attn_scalar``, attention logit
soft-capping, rope scaling, biases, tied embeddings, GPT-2's per-layer
attention scaling) lives inside the layer modules, which the parts share with
the unsplit model.
"""

from __future__ import annotations

from typing import Any

from splitfed.errors import UnsupportedModelError

FULL = "full_attention"
SLIDING = "sliding_attention"
BIDIRECTIONAL = "bidirectional"

LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2"})
GPT2_FAMILY = frozenset({"gpt2"})
BERT_FAMILY = frozenset({"bert"})
SUPPORTED_FAMILIES = LLAMA_FAMILY | GPT2_FAMILY | BERT_FAMILY

#: Families whose forward takes the mask kind of each layer from ``config.layer_types``.
_LAYER_TYPED = frozenset({"qwen2", "qwen3", "gemma2"})
#: Families whose causal-LM head soft-caps the logits by ``config.final_logit_softcapping``.
_SOFTCAPPED = frozenset({"gemma2"})


def attention_kinds(config: Any) -> list[str]:
    """The mask kind (:data:`FULL`, :data:`SLIDING` or :data:`BIDIRECTIONAL`) of each of ``config``'s layers."""
    family = config.model_type
    count = int(config.num_hidden_layers)
    if family == "mistral":
        return [SLIDING if getattr(config, "sliding_window", None) is not None else FULL] * count
    if family in _LAYER_TYPED and getattr(config, "layer_types", None) is not None:
        return list(config.layer_types)
    if family in BERT_FAMILY:
        return [FULL if getattr(config, "is_decoder", False) else BIDIRECTIONAL] * count
    return [FULL] * count


def logit_softcap(config: Any) -> float | None:
    """The cap the family's head applies to its logits (``cap * tanh(logits / cap)``), or None."""
    if config.model_type in _SOFTCAPPED:
        return getattr(config, "final_logit_softcapping", None)
    return None


def check_config(config: Any) -> None:
    """Raise :class:`UnsupportedModelError` for configs a split cannot reproduce exactly."""
    if getattr(config, "is_heterogeneous", False):
        raise UnsupportedModelError(
            f"{config.model_type} config has per_layer_config overrides, which splitting does not support; "
            "load the model without per-layer overrides")
    unknown = sorted(set(attention_kinds(config)) - {FULL, SLIDING, BIDIRECTIONAL})
    if unknown:
        raise UnsupportedModelError(f"{config.model_type} config has layer types {unknown}; splitting supports "
                                    f"{FULL!r} and {SLIDING!r} layers only")
