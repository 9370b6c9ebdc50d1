"""Splits of plain ``nn.Sequential`` models (the CNNs): a cut is an index into the sequence."""

from __future__ import annotations

import torch
from torch import nn

from splitfed.split.base import CutState, Part, PartSpec, Role


class SequentialPart(Part):
    """A slice of an ``nn.Sequential``; the bottom takes a tensor, the top returns logits."""

    def __init__(self, spec: PartSpec, layers: nn.Sequential) -> None:
        super().__init__()
        self.spec = spec
        self.layers = layers

    def forward(self, x: torch.Tensor | CutState, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> CutState | torch.Tensor:
        """Bottom: tensor -> CutState; trunk: CutState -> CutState; top: CutState -> logits.

        A trunk given a state with ``blocks`` runs only those blocks (a client with its own cut).
        """
        if isinstance(x, CutState):
            layers = self.layers[self.block_slice(x)] if x.blocks is not None else self.layers
            out = layers(x.hidden)
            return out if self.spec.role == "top" else x.with_hidden(out)
        out = self.layers(x)
        return out if self.spec.role == "top" else CutState(out)


def split_sequential(model: nn.Sequential, a: int, b: int) -> tuple[SequentialPart, SequentialPart, SequentialPart]:
    """Cut ``model`` into ``model[:a]``, ``model[a:b]`` and ``model[b:]`` (modules shared, not copied)."""
    n = len(model)

    def spec(role: Role, first: int, count: int) -> PartSpec:
        pairs = tuple((f"layers.{i}.", f"{first + i}.") for i in range(count))
        return PartSpec(role=role, arch="sequential", first_layer=first, num_layers=count, prefixes=pairs)

    mods = list(model)
    return (SequentialPart(spec("bottom", 0, a), nn.Sequential(*mods[:a])),
            SequentialPart(spec("trunk", a, b - a), nn.Sequential(*mods[a:b])),
            SequentialPart(spec("top", b, n - b), nn.Sequential(*mods[b:])))
