"""Heterogeneous cut depth per client: each client's cut, the trunk's range, and state named by model block.

With ``client-cuts = "a,b a,b ..."`` clients hold cuts of their own, assigned by
partition id (round robin; a node's ``--node-config "cuts='a,b'"`` overrides).
A client with cut ``(a, b)`` holds blocks ``[0, a)`` in its bottom and ``[b, n)``
in its top; the trunk holds ``[min a, max b)`` over the plan and runs only
``[a, b)`` for that client (the split channel carries the cut in every Forward).

Because the same block sits in different parts for different clients, what the
client parts exchange is named as in the unsplit model (``model.layers.4.…``,
``3.weight``): :func:`full_state` and :func:`load_full_state` translate a part's
names with its :class:`~splitfed.split.PartSpec`. The merge of a round's copies
is in :mod:`splitfed.split.cutmerge`. LoRA adapters are seeded per block
(:func:`seed_adapters_by_block`), so every holder of a block starts from the same
adapters whatever part holds it.
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from splitfed.config import RunConfig, parse_client_cuts
from splitfed.errors import ConfigError, SplitError
from splitfed.split.base import Part, unique_state

log = logging.getLogger(__name__)

#: node-config key of a node's own cut ("a,b"), which overrides ``client-cuts``.
NODE_CUTS_KEY = "cuts"


@dataclass(frozen=True)
class CutPlan:
    """The run's client cuts, assigned by partition id (round robin)."""

    cuts: tuple[tuple[int, int], ...]

    @classmethod
    def from_config(cls, cfg: RunConfig) -> CutPlan | None:
        """The plan of ``client-cuts``, or None when clients share the run's ``cuts``."""
        if not cfg.client_cuts:
            return None
        return cls(tuple(parse_client_cuts(cfg.client_cuts)))

    @property
    def trunk_range(self) -> tuple[int, int]:
        """The blocks the trunk holds: ``[min a, max b)``."""
        return min(a for a, _ in self.cuts), max(b for _, b in self.cuts)

    def for_partition(self, partition_id: int) -> tuple[int, int]:
        """The cut of partition ``partition_id``."""
        return self.cuts[int(partition_id) % len(self.cuts)]


def node_cut(cfg: RunConfig, partition_id: int, node_config: Mapping[str, object] | None = None
             ) -> tuple[int, int] | None:
    """A client's cut: the node's ``cuts`` node-config value, else its ``client-cuts`` entry; None when the
    run has no client cuts (every client uses ``cuts``)."""
    plan = CutPlan.from_config(cfg)
    if plan is None:
        return None
    own = (node_config or {}).get(NODE_CUTS_KEY)
    if own not in (None, ""):
        entries = parse_client_cuts(str(own).strip("'\""))
        if len(entries) != 1:
            raise ConfigError(f"node-config cuts must be one 'a,b' pair, got {own!r}")
        return entries[0]
    return plan.for_partition(partition_id)


def client_config(cfg: RunConfig, partition_id: int, node_config: Mapping[str, object] | None = None) -> RunConfig:
    """The run config as a client sees it: ``cuts`` set to its own cut when the run has client cuts."""
    cut = node_cut(cfg, partition_id, node_config)
    return cfg if cut is None else dataclasses.replace(cfg, cuts=cut)


def server_config(cfg: RunConfig) -> RunConfig:
    """The run config as the server sees it: ``cuts`` set to the trunk's range when the run has client cuts."""
    plan = CutPlan.from_config(cfg)
    if plan is None:
        return cfg
    lo, hi = plan.trunk_range
    if lo == hi:
        raise ConfigError(f"client-cuts {cfg.client_cuts!r} leave the trunk no block (every a == b); give at "
                          "least one client a < b")
    return dataclasses.replace(cfg, cuts=(lo, hi))


# -- state by model block ------------------------------------------------------------------------------
def _has_lora(part: nn.Module) -> bool:
    return hasattr(_plain(part), "peft_config")


def _plain(part: Any) -> Any:
    """The part itself, under a ``torch.compile`` wrapper (whose state-dict keys gain a prefix)."""
    return getattr(part, "_orig_mod", part)


def part_state(part: nn.Module) -> dict[str, torch.Tensor]:
    """What a part exchanges, by its own names: its adapters with LoRA, else every (untied) weight and buffer."""
    part = _plain(part)
    if _has_lora(part):
        from peft import get_peft_model_state_dict

        return {k: v.detach() for k, v in get_peft_model_state_dict(part).items()}
    return unique_state(part)


def full_state(parts: Iterable[Part]) -> dict[str, torch.Tensor]:
    """The exchanged state of ``parts`` named as in the unsplit model (a tied tensor once, first name wins;
    with LoRA, adapters only)."""
    parts = [_plain(p) for p in parts]
    lora = any(_has_lora(p) for p in parts)
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for part in parts:
        if lora and not _has_lora(part):
            continue  # with LoRA only adapters travel (a part without target modules is frozen whole)
        own = part.state_dict(keep_vars=True)
        for key, value in part_state(part).items():
            ident = id(own.get(key, value))
            if ident in seen:
                continue
            seen.add(ident)
            out[part.spec.full_key(key)] = value
    return out


def load_full_state(parts: Iterable[Part], state: Mapping[str, torch.Tensor]) -> None:
    """Load the blocks each of ``parts`` holds from ``state`` (named as in the unsplit model).

    Keys of blocks other parts hold are skipped; a key one of ``parts`` needs and ``state`` lacks raises
    :class:`SplitError`.
    """
    parts = [_plain(p) for p in parts]
    missing = sorted(set(full_state(parts)) - set(state))
    if missing:
        raise SplitError(f"the global state lacks {len(missing)} tensors these parts hold, e.g. {missing[:3]}; "
                         "were the state and the parts built with the same model, LoRA settings and client-cuts?")
    for part in parts:
        sub = {}
        for key, value in state.items():
            mine = part.spec.part_key(key)
            if mine is not None:
                sub[mine] = value
        if _has_lora(part):
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(part, sub)
            continue
        own = part.state_dict(keep_vars=True)
        with torch.no_grad():
            for key, value in sub.items():
                if key in own:
                    if own[key].shape != value.shape:
                        raise SplitError(f"{part.spec.full_key(key)}: shape {tuple(value.shape)} does not match "
                                         f"the part's {tuple(own[key].shape)}")
                    own[key].copy_(value)


def block_state(part: Part, start: int, end: int) -> dict[str, torch.Tensor]:
    """The exchanged state of ``part``'s blocks ``[start, end)`` (model block indices), unsplit names."""
    part = _plain(part)
    first = part.spec.first_layer
    prefixes = tuple(f"layers.{i - first}." for i in range(max(start, first),
                                                           min(end, first + part.spec.num_layers)))
    if not prefixes:
        return {}
    return {part.spec.full_key(k): v for k, v in part_state(part).items() if k.startswith(prefixes)}


def trunk_blocks(runtime: Any, start: int, end: int) -> dict[str, torch.Tensor]:
    """A copy of the trunk runtime's blocks ``[start, end)`` (unsplit names), taken under its lock."""
    with runtime._lock:
        return {k: v.detach().clone() for k, v in block_state(runtime.trunk, start, end).items()}


def load_trunk_blocks(runtime: Any, state: Mapping[str, torch.Tensor]) -> None:
    """Load the trunk runtime's blocks from ``state`` (the round's global version), under its lock."""
    with runtime._lock:
        load_full_state([runtime.trunk], state)


def seed_adapters_by_block(part: Part, seed: int) -> None:
    """Re-initialise ``part``'s LoRA adapters from a seed per module of the unsplit model, so a block's
    adapters start the same in whichever part holds it."""
    from peft.tuners.lora import LoraLayer

    for name, module in part.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        full = part.spec.full_key(name + ".")
        torch.manual_seed(seed * 1_000_003 + zlib.crc32(full.encode()))
        for adapter in list(module.lora_A.keys()):
            module.reset_lora_parameters(adapter, True)


__all__ = ["NODE_CUTS_KEY", "CutPlan", "block_state", "client_config", "full_state", "load_full_state",
           "load_trunk_blocks", "node_cut", "part_state", "seed_adapters_by_block", "server_config", "trunk_blocks"]
