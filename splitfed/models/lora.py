"""LoRA (peft) on every part: adapters injected in place, only adapters trainable and exchanged.

The client's bottom and top and the server's trunk each get LoRA adapters on the
architecture's projection layers; everything else is frozen. Only adapter
tensors travel in Flower messages (``get_peft_model_state_dict`` /
``set_peft_model_state_dict`` per part), and the trunk's adapters train on the
server. :func:`merge_lora` folds the adapters into the base weights for export.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from splitfed.errors import ConfigError

log = logging.getLogger(__name__)

_LLAMA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGETS: dict[str, list[str]] = {
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA, "gemma": _LLAMA,
    "bert": ["query", "key", "value", "dense"],
}


#: Layer types peft's LoRA adapts (``Conv1D`` is GPT-2's), by class name.
LORA_LAYER_TYPES = frozenset({"Linear", "Embedding", "Conv1d", "Conv2d", "Conv3d", "Conv1D"})


def sequential_layers(parts: Iterable[nn.Module]) -> dict[str, str]:
    """An ``nn.Sequential`` model's layers that LoRA can adapt, among those ``parts`` hold: the full model's
    layer index (what ``print(model)`` shows, and what ``lora-targets`` names) -> the layer's type."""
    out: dict[str, str] = {}
    for part in parts:
        for name, module in part.named_modules():
            if name and type(module).__name__ in LORA_LAYER_TYPES:
                out[part.spec.full_key(name + ".")[:-1]] = type(module).__name__
    return dict(sorted(out.items(), key=lambda kv: [int(x) if x.isdigit() else x for x in kv[0].split(".")]))


def check_sequential_targets(model: str, parts: Sequence[nn.Module], targets: list[str] | None,
                             every_part: bool) -> None:
    """Refuse ``lora-targets`` of an ``nn.Sequential`` model that name no LoRA-able layer, listing the ones there
    are (only layers of ``parts`` are known; ``every_part``: the parts are the whole model)."""
    layers = sequential_layers(parts)
    listing = ", ".join(f"{name} ({kind})" for name, kind in layers.items())
    example = ",".join(list(layers)[-2:])
    if not targets:
        raise ConfigError(f"{model} is an nn.Sequential model, with no default LoRA targets: set lora-targets to "
                          f"the indices of the layers to adapt, among {listing} (e.g. lora-targets = "
                          f"\"{example}\")")
    held = {k for part in parts for k in _sequential_indices(part)}
    bad = [t for t in targets if t not in layers and (t in held or every_part)]
    if bad:
        raise ConfigError(f"lora-targets {', '.join(map(repr, bad))} name no layer of {model} that LoRA can "
                          f"adapt; it has {listing} (e.g. lora-targets = \"{example}\")")


def _sequential_indices(part: nn.Module) -> list[str]:
    """The full model's layer indices a part of an ``nn.Sequential`` model holds."""
    return [theirs[:-1] for _, theirs in part.spec.prefixes]


def lora_config(arch: str, rank: int, alpha: float | None = None, dropout: float = 0.0,
                targets: list[str] | None = None) -> object:
    """A peft ``LoraConfig`` for ``arch`` (GPT-2's Conv1D layers need ``fan_in_fan_out``)."""
    from splitfed.extras import require

    LoraConfig = require("peft", "LoRA (lora-rank > 0)").LoraConfig

    if rank < 1:
        raise ConfigError(f"lora-rank must be >= 1 to use LoRA (0 means full fine-tuning), got {rank}")
    if targets is None:
        if arch not in TARGETS:
            raise ConfigError(f"no default LoRA target modules for {arch!r}; set lora-targets to the names of "
                              "its Linear (or Conv1d/Conv2d, Embedding) modules")
        targets = TARGETS[arch]
    return LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, lora_dropout=dropout,
                      target_modules=targets, fan_in_fan_out=(arch == "gpt2"), bias="none")


def _has_targets(part: nn.Module, targets: list[str]) -> bool:
    return any(name.rsplit(".", 1)[-1] in targets or name in targets for name, _ in part.named_modules())


def apply_lora(part: nn.Module, config: object, seed: int | None = None) -> int:
    """Inject adapters into ``part`` in place and freeze everything else; returns trainable parameter count.

    A part with no target modules (a bottom of embeddings only) is frozen whole.
    ``seed`` makes the adapters' initial values the same on every party.
    """
    from peft import inject_adapter_in_model

    targets = list(config.target_modules)  # type: ignore[attr-defined]
    spec = getattr(part, "spec", None)
    if spec is not None and spec.arch == "sequential":  # targets are the full model's layer indices
        local = [ours[:-1] for ours, theirs in spec.prefixes if theirs[:-1] in targets]
        config = copy.deepcopy(config)
        config.target_modules = local  # type: ignore[attr-defined]
        targets = local
    if _has_targets(part, targets):
        if seed is not None:
            torch.manual_seed(seed)
        inject_adapter_in_model(config, part)
    for name, p in part.named_parameters():
        p.requires_grad = "lora_" in name
    trainable = sum(p.numel() for p in part.parameters() if p.requires_grad)
    log.debug("LoRA on %s: %d trainable parameters", type(part).__name__, trainable)
    return trainable


def has_lora(part: nn.Module) -> bool:
    """Whether ``part`` carries LoRA adapters."""
    return hasattr(part, "peft_config")


def adapter_state(parts: Mapping[str, nn.Module]) -> dict[str, torch.Tensor]:
    """The adapters of several parts, keys prefixed by part name (``bottom.…``, ``top.…``)."""
    from peft import get_peft_model_state_dict

    out: dict[str, torch.Tensor] = {}
    for prefix, part in parts.items():
        if has_lora(part):
            for key, value in get_peft_model_state_dict(part).items():
                out[f"{prefix}.{key}"] = value.detach()
    return out


def load_adapter_state(parts: Mapping[str, nn.Module], state: Mapping[str, torch.Tensor]) -> None:
    """Load what :func:`adapter_state` returned into the same parts."""
    from peft import set_peft_model_state_dict

    for prefix, part in parts.items():
        sub = {k[len(prefix) + 1:]: v for k, v in state.items() if k.startswith(prefix + ".")}
        if not has_lora(part):
            if sub:
                raise ConfigError(f"adapters for {prefix} arrived but that part has no LoRA; check lora-rank")
            continue
        result = set_peft_model_state_dict(part, sub)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise ConfigError(f"adapter keys do not fit the {prefix} part: {unexpected[:5]}")


def merge_lora(part: nn.Module) -> None:
    """Fold the adapters into the base weights and put the plain layers back (in place)."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(part.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent_name, _, attr = name.rpartition(".")
            parent = part.get_submodule(parent_name) if parent_name else part
            setattr(parent, attr, module.get_base_layer())
    if hasattr(part, "peft_config"):
        del part.peft_config
