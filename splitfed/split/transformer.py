"""Exact three-way splits of Hugging Face transformers (transformers 5.x conventions).

Supported: GPT-2 (causal LM), the Llama family (Llama, Mistral, Qwen2, Qwen3,
Gemma, Gemma 2; causal LM) and BERT (sequence classification). Each part owns a
contiguous run of blocks, re-indexed from 0 so that it can hold its own
``DynamicCache``, and a copy of the model config whose ``num_hidden_layers``
(and ``layer_types``) describe just those blocks. Masks and rotary embeddings
are rebuilt per part from the 2-D padding mask and the position ids that cross
the cut, following the family's own rules (:mod:`splitfed.split.families`), so a
split model computes exactly what the unsplit model computes.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from transformers.masking_utils import (
    create_bidirectional_mask,
    create_causal_mask,
    create_sliding_window_causal_mask,
)
from transformers.models.bert.modeling_bert import BertModel

from splitfed.split.base import CutState, Part, PartSpec, Role, reindex_layers
from splitfed.split.compat import cache_positions, call_layer, call_mask, masks_read_positions, takes_cache_position
from splitfed.split.families import (
    BERT_FAMILY,
    BIDIRECTIONAL,
    FULL,
    GPT2_FAMILY,
    LLAMA_FAMILY,
    SLIDING,
    attention_kinds,
    check_config,
    logit_softcap,
)

_MASKS = {FULL: create_causal_mask, SLIDING: create_sliding_window_causal_mask}


def part_config(config: Any, first: int, count: int) -> Any:
    """A copy of ``config`` describing only blocks ``[first, first + count)``."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = count
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        cfg.layer_types = list(layer_types[first:first + count])
    return cfg


def default_positions(hidden: torch.Tensor, past: int) -> torch.Tensor:
    """Position ids of shape (B, T): ``past + arange(T)``, as the unsplit models use by default.

    Left-padded generation passes explicit positions instead (see :func:`left_padded_positions`).
    """
    batch, length = hidden.shape[:2]
    return (torch.arange(length, device=hidden.device) + past).unsqueeze(0).expand(batch, length)


def left_padded_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: ``cumsum(mask) - 1``, 0 on padding (what ``generate`` uses)."""
    mask = attention_mask.long()
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


class TransformerPart(Part):
    """A run of transformer blocks plus, by role, the embeddings or the final norm and head."""

    def __init__(self, spec: PartSpec, config: Any, layers: list[nn.Module], *, embed: nn.Module | None = None,
                 norm: nn.Module | None = None, head: nn.Module | None = None,
                 rotary: nn.Module | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.config = part_config(config, spec.first_layer, spec.num_layers)
        self.layers = nn.ModuleList(layers)
        reindex_layers(self.layers)
        self.embed = embed
        self.norm = norm
        self.head = head
        # Buffer-only (cos/sin tables): each part gets its own copy.
        self.rotary = copy.deepcopy(rotary) if rotary is not None else None
        family = config.model_type
        if family in GPT2_FAMILY:
            self._runner: _Runner = _GPT2Runner()
        elif family in BERT_FAMILY:
            self._runner = _BertRunner()
        else:
            self._runner = _LlamaRunner()

    def check_input(self, state: CutState) -> None:
        """Raise ``ValueError`` if ``state`` cannot be this part's input (wrong rank or hidden size)."""
        h = state.hidden
        if h.dim() != 3 or h.shape[-1] != self.config.hidden_size:
            raise ValueError(f"hidden must be (batch, length, {self.config.hidden_size}), got {list(h.shape)}")

    def run_layers(self, state: CutState, cache: Any = None, use_cache: bool = False) -> torch.Tensor:
        """Run this part's blocks on ``state.hidden`` (only ``state.blocks`` of them when set)."""
        blocks = self.block_slice(state)
        if blocks.start == blocks.stop:
            return state.hidden
        if cache is not None and (blocks.start, blocks.stop) != (0, len(self.layers)):
            raise ValueError(f"a KV cache needs the part's whole range of blocks; got blocks {state.blocks}")
        return self._runner.run(self, state, cache, use_cache, blocks)

    def fixed_decoding(self) -> bool:
        """Whether :meth:`decode_fixed` can run this part: a decoder family whose blocks all attend to the full past
        through PyTorch's ``scaled_dot_product_attention`` (the kernels a prebuilt boolean mask is meant for)."""
        rope = str(getattr(self.rotary, "rope_type", "default"))
        return (self._runner.fixed and getattr(self.config, "_attn_implementation", None) == "sdpa"
                and all(kind == FULL for kind in attention_kinds(self.config))
                and "dynamic" not in rope and rope != "longrope")  # these read the positions back to the host

    def decode_fixed(self, hidden: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor,
                     cache_position: torch.Tensor, cache: Any) -> torch.Tensor:
        """One step of all the part's blocks over a cache of fixed size, every input already on the device.

        ``mask`` is the boolean attention mask as the blocks take it, ``(batch, 1, length, cache size)``;
        ``position_ids`` are the rows' positions and ``cache_position`` the cache columns the step writes
        (a device tensor, read by the cache's ``update``). Nothing here reads a value back to the host or depends
        on one, so the step can be captured in a CUDA graph
        (:mod:`splitfed.trunk.inference.fixedsteps`). Only parts with :meth:`fixed_decoding` take it.
        """
        if not self.fixed_decoding():
            raise ValueError("this part cannot decode over a fixed-size cache: it needs a decoder family whose "
                             "blocks all attend to the full past with attn_implementation='sdpa'")
        return self._runner.run_fixed(self, hidden, mask, position_ids, cache_position, cache)

    def new_cache(self) -> Any:
        """A fresh KV cache sized for this part's blocks."""
        from transformers import DynamicCache

        return DynamicCache(config=self.config)


class TransformerBottom(TransformerPart):
    """Embeddings and the first blocks; turns token ids into a :class:`CutState`."""

    def embed_tokens(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                     token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The embeddings of ``input_ids`` at ``position_ids``, as the family's model computes them before its first
        block."""
        return self._runner.embed(self, input_ids, position_ids, token_type_ids)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: Any = None, use_cache: bool = False,
                token_type_ids: torch.Tensor | None = None) -> CutState:
        """Embed ``input_ids`` (and ``token_type_ids`` where the family uses them) and run the bottom blocks."""
        past = cache.get_seq_length() if cache is not None else 0
        positions = default_positions(input_ids, past) if position_ids is None else position_ids
        hidden = self.embed_tokens(input_ids, positions, token_type_ids)
        # Default positions do not travel: each part makes them again from its own cache (see _Runner.positions).
        state = CutState(hidden, attention_mask, position_ids if self._runner.uses_positions else None)
        return state.with_hidden(self.run_layers(state, cache, use_cache))


class TransformerTrunk(TransformerPart):
    """The middle blocks: a :class:`CutState` in, a :class:`CutState` out."""

    def forward(self, state: CutState, cache: Any = None, use_cache: bool = False) -> CutState:
        """Run the trunk blocks."""
        return state.with_hidden(self.run_layers(state, cache, use_cache))


class TransformerTop(TransformerPart):
    """The last blocks, the final norm and the head; returns logits."""

    def forward(self, state: CutState, cache: Any = None, use_cache: bool = False) -> torch.Tensor:
        """Run the top blocks and the head."""
        hidden = self.run_layers(state, cache, use_cache)
        return self.logits(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm and the head (and the family's logit soft-capping) on the last block's output."""
        return self._runner.head(self, hidden)


class _Runner:
    """Per-family calling convention of blocks, masks, embeddings and heads."""

    uses_positions = True
    #: whether :meth:`run_fixed` is implemented (decoder families)
    fixed = False

    def run_fixed(self, part: TransformerPart, hidden: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor,
                  cpos: torch.Tensor, cache: Any) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def positions(state: CutState, cache: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The positions of ``state``'s tokens for the blocks, and those the mask functions are given.

        A state without positions holds the default ones (``past + arange``; the bottom leaves them out), which a
        part makes again from its cache. The mask functions then get none: given positions and no padding mask,
        they look for packed sequences, a check whose answer the host must read back from the device, which
        stalls the GPU's queue at every part; default positions are never packed, so their mask is the same
        without it. Explicit positions are passed on as given.
        """
        if state.position_ids is not None:
            return state.position_ids, state.position_ids
        return default_positions(state.hidden, cache.get_seq_length() if cache is not None else 0), None

    def embed(self, part: TransformerPart, input_ids: torch.Tensor, position_ids: torch.Tensor,
              token_type_ids: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def run(self, part: TransformerPart, state: CutState, cache: Any, use_cache: bool,
            blocks: slice) -> torch.Tensor:
        raise NotImplementedError

    def head(self, part: TransformerPart, hidden: torch.Tensor) -> torch.Tensor:
        hidden = part.norm(hidden) if part.norm is not None else hidden
        logits = part.head(hidden)
        cap = logit_softcap(part.config)
        if cap is not None:  # the same three operations as the family's head
            logits = logits / cap
            logits = torch.tanh(logits)
            logits = logits * cap
        return logits


class _GPT2Runner(_Runner):
    fixed = True

    def run_fixed(self, part: TransformerPart, hidden: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor,
                  cpos: torch.Tensor, cache: Any) -> torch.Tensor:
        for block in part.layers:
            hidden = call_layer(block, hidden, cache=cache, cache_position=cpos, attention_mask=mask,
                                use_cache=True, position_ids=pos)
        return hidden

    def embed(self, part: TransformerPart, input_ids: torch.Tensor, position_ids: torch.Tensor,
              token_type_ids: torch.Tensor | None) -> torch.Tensor:
        emb = part.embed
        hidden = emb.wte(input_ids) + emb.wpe(position_ids)
        if token_type_ids is not None:  # GPT2Model embeds token types with the word embeddings
            hidden = hidden + emb.wte(token_type_ids)
        return emb.drop(hidden)

    def run(self, part: TransformerPart, state: CutState, cache: Any, use_cache: bool,
            blocks: slice) -> torch.Tensor:
        hidden = state.hidden
        pos, mask_pos = self.positions(state, cache)
        mask = call_mask(create_causal_mask, config=part.config, hidden=hidden,
                         attention_mask=state.attention_mask, cache=cache, position_ids=mask_pos)
        layers = part.layers[blocks]
        cpos = cache_positions(hidden, cache) if takes_cache_position(layers[0]) else None
        for block in layers:
            hidden = call_layer(block, hidden, cache=cache, cache_position=cpos, attention_mask=mask,
                                use_cache=use_cache, position_ids=pos)
        return hidden


class _LlamaRunner(_Runner):
    fixed = True

    def run_fixed(self, part: TransformerPart, hidden: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor,
                  cpos: torch.Tensor, cache: Any) -> torch.Tensor:
        position_embeddings = part.rotary(hidden, position_ids=pos)
        for layer in part.layers:
            hidden = call_layer(layer, hidden, cache=cache, cache_position=cpos, attention_mask=mask,
                                position_embeddings=position_embeddings, position_ids=pos, use_cache=True)
        return hidden

    def embed(self, part: TransformerPart, input_ids: torch.Tensor, position_ids: torch.Tensor,
              token_type_ids: torch.Tensor | None) -> torch.Tensor:
        return part.embed(input_ids)  # the Llama family ignores token types, as its forward does

    def run(self, part: TransformerPart, state: CutState, cache: Any, use_cache: bool,
            blocks: slice) -> torch.Tensor:
        hidden = state.hidden
        pos, mask_pos = self.positions(state, cache)
        kinds = attention_kinds(part.config)[blocks]
        masks = {kind: call_mask(_MASKS[kind], config=part.config, hidden=hidden, attention_mask=state.attention_mask,
                                 cache=cache, position_ids=mask_pos) for kind in dict.fromkeys(kinds)}
        position_embeddings = part.rotary(hidden, position_ids=pos)
        layers = part.layers[blocks]
        cpos = cache_positions(hidden, cache) if takes_cache_position(layers[0]) else None
        for layer, kind in zip(layers, kinds, strict=True):
            hidden = call_layer(layer, hidden, cache=cache, cache_position=cpos, attention_mask=masks[kind],
                                position_embeddings=position_embeddings, position_ids=pos, use_cache=use_cache)
        return hidden


class _BertRunner(_Runner):
    def __init__(self) -> None:
        # Absolute positions are added inside the embeddings; they travel to the other parts only where the
        # installed release's BertModel also builds its masks from them (packed sequences).
        self.uses_positions = masks_read_positions(BertModel)

    def embed(self, part: TransformerPart, input_ids: torch.Tensor, position_ids: torch.Tensor,
              token_type_ids: torch.Tensor | None) -> torch.Tensor:
        return part.embed(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids)

    def run(self, part: TransformerPart, state: CutState, cache: Any, use_cache: bool,
            blocks: slice) -> torch.Tensor:
        hidden = state.hidden
        if attention_kinds(part.config)[0] == BIDIRECTIONAL:
            mask = call_mask(create_bidirectional_mask, config=part.config, hidden=hidden,
                             attention_mask=state.attention_mask, position_ids=state.position_ids, with_cache=False)
        else:  # is_decoder: the causal mask
            mask = call_mask(create_causal_mask, config=part.config, hidden=hidden,
                             attention_mask=state.attention_mask, cache=cache, position_ids=state.position_ids)
        for layer in part.layers[blocks]:
            hidden = call_layer(layer, hidden, attention_mask=mask)
        return hidden

    def head(self, part: TransformerPart, hidden: torch.Tensor) -> torch.Tensor:
        pooled = part.norm(hidden)  # BertPooler: first token, dense, tanh
        return part.head(pooled)


def _spec(role: Role, arch: str, first: int, count: int, pairs: list[tuple[str, str]],
          layer_prefix: str) -> PartSpec:
    layers = [(f"layers.{i}.", f"{layer_prefix}{first + i}.") for i in range(count)]
    return PartSpec(role=role, arch=arch, first_layer=first, num_layers=count, prefixes=tuple(pairs + layers))


def split_transformer(model: nn.Module, a: int, b: int) -> tuple[TransformerBottom, TransformerTrunk, TransformerTop]:
    """Cut a supported transformers model into parts sharing the model's modules (no copies).

    The parts re-index their attention layers, so the original model object
    should not be used with a KV cache afterwards.
    """
    config = model.config
    family = config.model_type
    check_config(config)
    if family in GPT2_FAMILY:
        base, n = model.transformer, config.num_hidden_layers
        embed = nn.Module()
        embed.wte, embed.wpe, embed.drop = base.wte, base.wpe, base.drop
        layers, prefix = list(base.h), "transformer.h."
        emb_pairs = [("embed.wte.", "transformer.wte."), ("embed.wpe.", "transformer.wpe.")]
        norm, head = base.ln_f, model.lm_head
        top_pairs = [("norm.", "transformer.ln_f."), ("head.", "lm_head.")]
        rotary = None
    elif family in LLAMA_FAMILY:
        base, n = model.model, config.num_hidden_layers
        embed, layers, prefix = base.embed_tokens, list(base.layers), "model.layers."
        emb_pairs = [("embed.", "model.embed_tokens.")]
        norm, head = base.norm, model.lm_head
        top_pairs = [("norm.", "model.norm."), ("head.", "lm_head.")]
        rotary = base.rotary_emb
    elif family in BERT_FAMILY:
        base, n = model.bert, config.num_hidden_layers
        if base.pooler is None:
            raise NotImplementedError("BERT without a pooler has no classification head to split")
        embed, layers, prefix = base.embeddings, list(base.encoder.layer), "bert.encoder.layer."
        emb_pairs = [("embed.", "bert.embeddings.")]
        norm = base.pooler
        head = nn.Sequential(model.dropout, model.classifier)
        top_pairs = [("norm.", "bert.pooler."), ("head.1.", "classifier.")]
        rotary = None
    else:  # pragma: no cover - guarded by the registry
        raise NotImplementedError(family)
    bottom = TransformerBottom(_spec("bottom", family, 0, a, emb_pairs, prefix), config, layers[:a],
                               embed=embed, rotary=rotary)
    trunk = TransformerTrunk(_spec("trunk", family, a, b - a, [], prefix), config, layers[a:b], rotary=rotary)
    top = TransformerTop(_spec("top", family, b, n - b, top_pairs, prefix), config, layers[b:],
                         norm=norm, head=head, rotary=rotary)
    return bottom, trunk, top
