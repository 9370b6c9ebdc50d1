"""Optimizers by name, so client and server build the same kind from the run config."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from splitfed.errors import ConfigError

OPTIMIZERS = ("sgd", "adamw", "adam")


def make_optimizer(name: str, params: Iterable[torch.nn.Parameter], lr: float, *, momentum: float = 0.0,
                   weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """Build ``sgd``, ``adam`` or ``adamw`` over the parameters that require gradients."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ConfigError("the part has no trainable parameters; with LoRA, check lora-rank and target modules")
    if lr <= 0:
        raise ConfigError(f"lr must be > 0, got {lr}")
    key = name.lower()
    if key == "sgd":
        return torch.optim.SGD(trainable, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if key == "adamw":
        return torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay)
    if key == "adam":
        return torch.optim.Adam(trainable, lr=lr, weight_decay=weight_decay)
    raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")
