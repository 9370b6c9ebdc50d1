"""Exact model splitting: bottom (client), trunk (server) and top (client), plain torch/transformers."""

from __future__ import annotations

from torch import nn

from splitfed.errors import UnsupportedModelError
from splitfed.split.base import (
    CUT_FIELDS,
    CutState,
    Part,
    PartSpec,
    SplitModel,
    SplitOutput,
    Task,
    causal_lm_loss,
    check_cuts,
    classification_loss,
    load_unique_state,
    requested_blocks,
    unique_state,
)
from splitfed.split.families import BERT_FAMILY, GPT2_FAMILY, LLAMA_FAMILY, attention_kinds
from splitfed.split.sequential import SequentialPart, split_sequential
from splitfed.split.transformer import TransformerPart, split_transformer

SUPPORTED_ARCHITECTURES = sorted(GPT2_FAMILY | LLAMA_FAMILY | BERT_FAMILY) + ["nn.Sequential"]


def num_blocks(model: nn.Module) -> int:
    """How many cut-able blocks ``model`` has (layers of a transformer, modules of a Sequential)."""
    if isinstance(model, nn.Sequential):
        return len(model)
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in GPT2_FAMILY | LLAMA_FAMILY | BERT_FAMILY:
        raise UnsupportedModelError(
            f"cannot split {type(model).__name__}: supported are {', '.join(SUPPORTED_ARCHITECTURES)} "
            "(causal LMs for GPT-2 and the Llama family, sequence classification for BERT)")
    return int(config.num_hidden_layers)


def task_of(model: nn.Module) -> Task:
    """``causal-lm`` for decoder LMs, ``classification`` for BERT and Sequential models."""
    if isinstance(model, nn.Sequential):
        return "classification"
    return "classification" if model.config.model_type in BERT_FAMILY else "causal-lm"


def split_model(model: nn.Module, cuts: tuple[int, int] | list[int], micro_batches: int = 1) -> SplitModel:
    """Cut ``model`` at blocks ``cuts = (a, b)`` into bottom ``[0, a)``, trunk ``[a, b)`` and top ``[b, n)``.

    The parts share ``model``'s modules (nothing is copied; tied embeddings stay
    tied). The result runs all three locally; give ``result.trunk`` to a
    :class:`~splitfed.channel.server.trunkserver.TrunkServer` and keep ``result.bottom`` and
    ``result.top`` on the client. ``micro_batches``: see :class:`SplitModel`.
    """
    a, b = check_cuts(cuts, num_blocks(model))
    if isinstance(model, nn.Sequential):
        bottom, trunk, top = split_sequential(model, a, b)
        return SplitModel(bottom, trunk, top, task="classification", micro_batches=micro_batches)
    if model.config.model_type not in BERT_FAMILY and not hasattr(model, "lm_head"):
        raise UnsupportedModelError(f"{type(model).__name__} has no language-model head; load the model with "
                                    "AutoModelForCausalLM")
    bottom, trunk, top = split_transformer(model, a, b)
    return SplitModel(bottom, trunk, top, task=task_of(model), config=model.config, micro_batches=micro_batches)


__all__ = [
    "CUT_FIELDS",
    "SUPPORTED_ARCHITECTURES",
    "CutState",
    "Part",
    "PartSpec",
    "SequentialPart",
    "SplitModel",
    "SplitOutput",
    "TransformerPart",
    "attention_kinds",
    "causal_lm_loss",
    "check_cuts",
    "classification_loss",
    "load_unique_state",
    "num_blocks",
    "requested_blocks",
    "split_model",
    "task_of",
    "unique_state",
]
