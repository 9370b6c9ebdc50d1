"""A generating client's bottom and top over fixed-size KV caches, their decode steps replayed as CUDA graphs.

A client's decode step is bound by its host as the trunk's is: the bottom's and
the top's blocks, the embeddings and the head launch a few hundred small
kernels per token, and on a GPU launching them takes longer than computing
them. After the prompt's step (over the parts' growing caches, as always),
:class:`FixedDecoder` moves both caches into buffers of the generation's full
length (:class:`~splitfed.split.fixedcache.ColumnCache`), and each later step of
the bottom (token ids in, the cut's hidden states out) and of the top (the
trunk's output in, logits out) runs at a fixed shape: captured once per
generation as a CUDA graph and replayed (``decode_steps="graphs"``, what
``"auto"`` picks on a GPU), or run as it is (``"fixed"``, on any device: what
the graphs replay). ``generate``'s default is ``"auto"``; ``"dynamic"`` keeps the
growing caches. The attention mask (the prompt's padding, and the columns
up to the step) is built on the device from the column the step writes, so a
step reads nothing back to the host and copies nothing to the device but its
input.

The keys each position attends to are those of the growing cache, so logits
equal the growing cache's up to float rounding; greedy decoding picks the same
tokens but where two logits tie within that rounding.

Parts that qualify: :meth:`~splitfed.split.transformer.TransformerPart.fixed_decoding`
(GPT-2 and the Llama family, every block attending to the full past through
SDPA), bottom and top on one device.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from splitfed.errors import ConfigError
from splitfed.split.fixedcache import ColumnCache, capture, column_layers

log = logging.getLogger(__name__)

#: the choices of ``decode_steps`` (:func:`~splitfed.client.generation.generate`)
CLIENT_DECODE_STEPS = ("auto", "graphs", "fixed", "dynamic")
#: ``"auto"`` takes graphs for generations of at least this many tokens (capturing costs about two steps)
AUTO_MIN_TOKENS = 8


def device_of(module: nn.Module) -> torch.device:
    """The device of ``module``'s first parameter (the CPU for a module without any)."""
    param = next(module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def decoder_kind(bottom: nn.Module, top: nn.Module, choice: str, new_tokens: int) -> str | None:
    """What ``generate`` runs the parts' decode steps as under ``decode_steps=choice``: ``"graphs"``, ``"fixed"``
    or None (the growing caches).

    ``"graphs"`` asks for graphs and fails with :class:`ConfigError` where they cannot run (no GPU, parts that do not
    qualify); ``"auto"`` takes them where they can for ``new_tokens`` of at least :data:`AUTO_MIN_TOKENS`, and the
    growing caches elsewhere. A generation of one token has no decode step: None.
    """
    if choice not in CLIENT_DECODE_STEPS:
        raise ConfigError(f"decode_steps must be one of {', '.join(CLIENT_DECODE_STEPS)}; got {choice!r}")
    if choice == "dynamic" or new_tokens < 2:
        return None
    qualifies = all(callable(getattr(p, "fixed_decoding", None)) and p.fixed_decoding() for p in (bottom, top))
    device = device_of(bottom)
    same = device == device_of(top)
    if choice == "auto":
        return "graphs" if qualifies and same and device.type == "cuda" and new_tokens >= AUTO_MIN_TOKENS else None
    if not qualifies or not same:
        raise ConfigError(f"decode_steps={choice!r} needs a bottom and a top on one device whose blocks all attend "
                          "to the full past through SDPA (GPT-2 or the Llama family, attn_implementation='sdpa'); "
                          "use decode_steps='dynamic'")
    if choice == "graphs" and device.type != "cuda":
        raise ConfigError("decode_steps='graphs' needs the parts on a CUDA device; use 'fixed' or 'dynamic'")
    return choice


def _stored(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


class FixedDecoder:
    """The bottom's and the top's decode steps over fixed-size caches (see the module's docstring).

    Built after the prompt's step, from the parts' growing caches, which then hold ``length`` positions.

    Args:
        bottom, top: the client's parts (:meth:`fixed_decoding` true, one device).
        bottom_cache, top_cache: their caches after the prompt's step.
        valid: (batch, length) the prompt's padding mask (1 on tokens).
        positions: (batch, 1) the position ids of the first token to decode.
        capacity: positions the caches must hold (prompt and every token fed back).
        graphs: replay each step as a CUDA graph (the parts on a GPU).
    """

    def __init__(self, bottom: nn.Module, top: nn.Module, bottom_cache: Any, top_cache: Any, valid: torch.Tensor,
                 positions: torch.Tensor, capacity: int, graphs: bool) -> None:
        self.bottom, self.top = bottom, top
        device = device_of(bottom)
        self.device = device
        batch, length = valid.shape
        if capacity < length + 1:
            raise ValueError(f"capacity {capacity} leaves no room past the prompt's {length} positions")
        self.capacity = capacity
        self.graphs = graphs and device.type == "cuda"
        self.column = torch.full((1,), length, dtype=torch.long, device=device)
        self.valid = torch.ones(batch, capacity, dtype=torch.bool, device=device)
        self.valid[:, :length] = valid.to(device=device, dtype=torch.bool)
        self.columns = torch.arange(capacity, device=device)
        self.positions = positions.to(device=device, dtype=torch.long).clone()
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        width = int(top.config.hidden_size)
        self.hidden = torch.zeros(batch, 1, width, dtype=_dtype(top), device=device)
        self.bottom_cache = ColumnCache(column_layers(_stored(bottom_cache), length, capacity), self.column)
        self.top_cache = ColumnCache(column_layers(_stored(top_cache), length, capacity), self.column)
        self._graphs: dict[str, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.captures = 0
        #: positions the caches hold
        self.length = length

    def _mask(self) -> torch.Tensor:
        """(batch, 1, 1, capacity): the prompt's tokens and every column up to this step's."""
        return (self.valid & (self.columns <= self.column))[:, None, None, :]

    def _bottom(self) -> torch.Tensor:
        hidden = self.bottom.embed_tokens(self.ids, self.positions)
        return self.bottom.decode_fixed(hidden, self._mask(), self.positions, self.column, self.bottom_cache)

    def _top(self) -> torch.Tensor:
        hidden = self.top.decode_fixed(self.hidden, self._mask(), self.positions, self.column, self.top_cache)
        return self.top.logits(hidden)[:, -1, :]

    def _run(self, name: str, step: Any) -> torch.Tensor:
        if not self.graphs:
            return step()
        if name not in self._graphs:
            try:
                self._graphs[name] = capture(step, self.device)
                self.captures += 1
            except RuntimeError as exc:
                log.warning("could not capture the client's %s decode step as a CUDA graph (%s); stepping without "
                            "graphs (decode_steps='fixed')", name, exc)
                self.graphs = False
                return step()
        graph, out = self._graphs[name]
        graph.replay()
        return out

    @torch.no_grad()
    def bottom_step(self, ids: torch.Tensor) -> torch.Tensor:
        """The bottom's step on the (batch, 1) token ids; returns its (batch, 1, width) output (a new tensor)."""
        if self.length >= self.capacity:
            raise ValueError(f"the fixed caches hold {self.capacity} positions; all are used")
        self.ids.copy_(ids.view(self.ids.shape))
        return self._run("bottom", self._bottom).clone()

    @torch.no_grad()
    def top_step(self, hidden: torch.Tensor) -> torch.Tensor:
        """The top's step on the trunk's (batch, 1, width) output; returns the (batch, vocab) logits of this step.

        The logits are the decoder's own buffer, overwritten by the next step. Then the step is done: the next
        column and positions are taken.
        """
        self.hidden.copy_(hidden)
        logits = self._run("top", self._top)
        self.column += 1
        self.positions += 1
        self.length += 1
        return logits


def _dtype(module: nn.Module) -> torch.dtype:
    param = next(module.parameters(), None)
    return param.dtype if param is not None else torch.float32
