"""Each side's parts of the run's model: built from code (named models) or read part-only from a checkpoint,
with LoRA when ``lora-rank`` > 0, and the state that the client parts exchange each round."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from splitfed.config import RunConfig
from splitfed.data import TOPIC_GROUPS, ByteTokenizer
from splitfed.errors import ConfigError
from splitfed.models.catalog import NAMED, build_model
from splitfed.split import SplitModel, load_unique_state, split_model, unique_state

log = logging.getLogger(__name__)

ALL_ROLES = ("bottom", "trunk", "top")
CLIENT_ROLES = ("bottom", "top")
_ROLE_SEED = {"bottom": 1, "trunk": 2, "top": 3}


def is_pretrained(cfg: RunConfig) -> bool:
    """Whether the model comes from a checkpoint (named LLM, folder or hub id) rather than code."""
    return cfg.model not in NAMED


def model_cuts(cfg: RunConfig) -> tuple[int, int]:
    """``cuts``, or the named model's default."""
    if cfg.cuts is not None:
        return cfg.cuts
    if cfg.model in NAMED:
        return NAMED[cfg.model].default_cuts
    from splitfed.models.llm import NAMED_LLMS

    if cfg.model in NAMED_LLMS:
        return NAMED_LLMS[cfg.model].default_cuts
    raise ConfigError(f"cuts is empty; set cuts = \"A,B\" for model {cfg.model!r}")


def config_overrides(cfg: RunConfig) -> dict[str, Any]:
    """Config changes a pretrained model needs for this run (a classifier head sized for the data)."""
    from splitfed.models.llm import load_config, task_of_config

    if task_of_config(load_config(cfg.model)) == "classification":
        return {"num_labels": TOPIC_GROUPS}
    return {}


def lora_setup(cfg: RunConfig, split: SplitModel) -> object | None:
    """The run's LoRA config for this model, or None for full fine-tuning."""
    if cfg.lora_rank == 0:
        return None
    from splitfed.models.lora import check_sequential_targets, lora_config

    arch = split.bottom.spec.arch
    targets = [t.strip() for t in cfg.lora_targets.split(",") if t.strip()] or None
    if arch == "sequential":  # the CNN: lora-targets are the model's layer indices
        held = [p for p in (split.bottom, split.trunk, split.top) if not _on_meta(p)]
        check_sequential_targets(cfg.model, held, targets, every_part=len(held) == 3)
    return lora_config(arch, cfg.lora_rank, cfg.lora_alpha or None, cfg.lora_dropout, targets)


def _on_meta(part: nn.Module) -> bool:
    """Whether a part was left unread (its tensors on the meta device)."""
    return any(t.is_meta for t in part.parameters())


def build_parts(cfg: RunConfig, roles: Iterable[str] = ALL_ROLES) -> SplitModel:
    """The run's split model with ``roles`` materialized (all parts for named models built from code).

    Pretrained models are read part-only: parts not in ``roles`` stay on the meta
    device. With LoRA, adapters go on the materialized parts with a seed per part,
    so every party starts from the same adapters.
    """
    roles = tuple(roles)
    cuts = model_cuts(cfg)
    if cfg.model == "tiny-gpt2":
        split = split_model(build_model("tiny-gpt2", seed=cfg.seed, vocab_size=ByteTokenizer.vocab_size), cuts)
    elif cfg.model in NAMED:
        split = split_model(build_model(cfg.model, seed=cfg.seed), cuts)
    else:
        from splitfed.models.partload import load_parts

        split = load_parts(cfg.model, cuts, roles, **config_overrides(cfg))
    lora = lora_setup(cfg, split)
    if lora is not None:
        from splitfed.models.lora import apply_lora

        for role in roles:
            apply_lora(getattr(split, role), lora, seed=cfg.seed * 31 + _ROLE_SEED[role])
            if cfg.client_cuts:  # a block's adapters start the same in whichever part holds it
                from splitfed.models.hetero import seed_adapters_by_block

                seed_adapters_by_block(getattr(split, role), cfg.seed)
    if cfg.compile:
        for role in roles:
            # In place (nn.Module.compile): the part stays itself, so its state-dict keys stay plain for
            # checkpoints, exports, client-state records and LoRA adapters (torch.compile(part) would wrap it
            # and prefix every key with "_orig_mod.").
            getattr(split, role).compile()
    return split


def client_parts(split: SplitModel) -> dict[str, nn.Module]:
    """The client's parts by name."""
    return {"bottom": split.bottom, "top": split.top}


def client_state(split: SplitModel, full_keys: bool = False) -> dict[str, torch.Tensor]:
    """What the client parts exchange: adapters only with LoRA, else every (untied) weight.

    ``full_keys`` (runs with ``client-cuts``): named as in the unsplit model (see :mod:`splitfed.models.hetero`).
    """
    from splitfed.models.lora import adapter_state, has_lora

    if full_keys:
        from splitfed.models.hetero import full_state

        return full_state([split.bottom, split.top])

    parts = client_parts(split)
    if any(has_lora(p) for p in parts.values()):
        return adapter_state(parts)
    return unique_state(nn.ModuleDict(parts))


def load_client_state(split: SplitModel, state: Mapping[str, torch.Tensor], full_keys: bool = False) -> None:
    """Load what :func:`client_state` returned (an empty state keeps the parts as built)."""
    if not state:
        return
    if full_keys:
        from splitfed.models.hetero import load_full_state

        load_full_state([split.bottom, split.top], state)
        return
    from splitfed.models.lora import has_lora, load_adapter_state

    parts = client_parts(split)
    if any(has_lora(p) for p in parts.values()):
        load_adapter_state(parts, state)
    else:
        load_unique_state(nn.ModuleDict(parts), dict(state))


def initial_client_state(cfg: RunConfig, split: SplitModel) -> dict[str, torch.Tensor]:
    """What round 1 sends to clients: the parts (built from code) or nothing (clients read their checkpoint
    and seed the same adapters)."""
    if is_pretrained(cfg):
        return {}
    if cfg.client_cuts:  # every block: a client holds whichever its cut gives it
        from splitfed.models.hetero import full_state

        return full_state([split.bottom, split.trunk, split.top])
    return client_state(split)


def trainable_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable tensors of ``module`` by state-dict name (adapters only, with LoRA)."""
    names = {n for n, p in module.named_parameters() if p.requires_grad}
    return {k: v for k, v in module.state_dict().items() if k in names}


def state_nbytes(state: Mapping[str, torch.Tensor]) -> int:
    """Bytes of a state dict's tensors."""
    return sum(t.numel() * t.element_size() for t in state.values())


def full_split_for_export(cfg: RunConfig, trunk_state: Mapping[str, torch.Tensor],
                          clients: Mapping[str, torch.Tensor]) -> SplitModel:
    """All three parts with the run's trained weights (adapters merged), for export."""
    from splitfed.models.lora import has_lora, merge_lora

    split = build_parts(dataclasses.replace(cfg, compile=False), ALL_ROLES)
    missing, unexpected = split.trunk.load_state_dict(dict(trunk_state), strict=False)
    if unexpected:
        raise ConfigError(f"trunk checkpoint does not fit the model: unexpected {unexpected[:5]}")
    load_client_state(split, clients, full_keys=bool(cfg.client_cuts))
    for role in ALL_ROLES:
        part = getattr(split, role)
        if has_lora(part):
            merge_lora(part)
    return split
