"""Models by name: the embedded MNIST CNN, tiny GPT-2 for text, and pretrained transformers by name or path."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from splitfed.errors import ConfigError

log = logging.getLogger(__name__)


def mnist_cnn(width: int = 32, num_classes: int = 10) -> nn.Sequential:
    """A small CNN for 28x28 grey images; cut it with ``cuts=(3, 6)``.

    Blocks: ``[conv, relu, pool] [conv, relu, pool] [flatten, linear, relu, linear]``.
    """
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * width * 7 * 7, 128), nn.ReLU(), nn.Linear(128, num_classes),
    )


def tiny_gpt2_config(vocab_size: int, layers: int = 6, hidden: int = 256, heads: int = 4,
                     positions: int = 256) -> Any:
    """GPT-2 config of the size the benchmarks and text examples use (dropout off)."""
    from transformers import GPT2Config

    return GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab_size, n_positions=positions,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


@dataclass(frozen=True)
class ModelInfo:
    """What a named model is: how to build it, its task, its data and default cuts."""

    name: str
    task: str
    data: str
    default_cuts: tuple[int, int]


NAMED: dict[str, ModelInfo] = {
    "mnist-cnn": ModelInfo("mnist-cnn", "classification", "mnist", (3, 6)),
    "tiny-gpt2": ModelInfo("tiny-gpt2", "causal-lm", "pydoc", (2, 4)),
}


def build_model(name: str, *, seed: int = 0, vocab_size: int | None = None, dtype: torch.dtype | None = None,
                attn_implementation: str | None = None) -> nn.Module:
    """Build a model by name: a named model of :data:`NAMED`, else a pretrained one (a named LLM, a local
    folder or a hub id, through :func:`splitfed.models.llm.load_model`)."""
    torch.manual_seed(seed)
    if name == "mnist-cnn":
        return mnist_cnn()
    if name == "tiny-gpt2":
        from transformers import GPT2LMHeadModel

        if vocab_size is None:
            raise ConfigError("tiny-gpt2 needs the tokenizer's vocab_size")
        return GPT2LMHeadModel(tiny_gpt2_config(vocab_size))
    from splitfed.models.llm import load_model

    extra = {} if attn_implementation is None else {"_attn_implementation": attn_implementation}
    return load_model(name, dtype=dtype, **extra)
