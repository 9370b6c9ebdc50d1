"""Calling transformers' mask functions and decoder layers across transformers 5.x releases.

The keyword names moved during 5.x: earlier releases (5.4 among them) take
``past_key_values`` and a required ``cache_position`` in ``create_causal_mask``
and in the decoder layers, later ones ``cache`` and no ``cache_position``;
5.0-5.2 also named the hidden states ``input_embeds``, and GPT-2's block
returned a tuple. As Hugging Face's own code does for its callers, each
function's signature is read once (:func:`inspect.signature`) and the arguments
are passed under the names it declares, so a split computes on every supported
release exactly what that release's unsplit model computes. From 5.25 on,
BERT also gives its masks the caller's position ids (:func:`masks_read_positions`).

The lowest release pyproject.toml allows is 5.4: before it, GPT-2's attention
read its ``layer_idx`` at every forward for ``scale_attn_by_inverse_layer_idx``
and ``reorder_and_upcast_attn`` (eager), which a part's re-indexed layers change,
and Gemma scaled its embeddings in the model's forward rather than in the
embedding module the bottom part holds.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

#: Names, newest first, under which a release takes the KV cache.
_CACHE_NAMES = ("cache", "past_key_values", "past_key_value")
#: Names, newest first, under which a release takes the hidden states a mask is built for.
_EMBEDS_NAMES = ("inputs_embeds", "input_embeds")


@functools.lru_cache(maxsize=None)
def _parameters(fn: Callable[..., Any]) -> tuple[frozenset[str], bool]:
    """The keyword names ``fn`` declares, and whether it also takes ``**kwargs``."""
    params = inspect.signature(fn).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return frozenset(params), var_kw


def _first(names: tuple[str, ...], declared: frozenset[str], what: str, fn: Callable[..., Any]) -> str:
    for name in names:
        if name in declared:
            return name
    raise TypeError(f"{getattr(fn, '__qualname__', fn)} takes none of {names} for the {what}; "
                    "this transformers release is not supported: install one that pyproject.toml allows")


def cache_positions(hidden: torch.Tensor, cache: Any) -> torch.Tensor:
    """``past + arange(T)``: the cache slots of ``hidden``'s tokens (what releases with ``cache_position`` use)."""
    past = cache.get_seq_length() if cache is not None else 0
    return torch.arange(past, past + hidden.shape[1], device=hidden.device)


def call_mask(fn: Callable[..., Any], *, config: Any, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
              cache: Any = None, position_ids: torch.Tensor | None = None, with_cache: bool = True) -> Any:
    """Call a ``transformers.masking_utils`` mask function with the keyword names the installed release declares.

    ``with_cache=False`` leaves the cache (and cache positions) out, as the bidirectional mask takes none.
    """
    declared, _ = _parameters(fn)
    kwargs: dict[str, Any] = {"config": config, _first(_EMBEDS_NAMES, declared, "hidden states", fn): hidden,
                              "attention_mask": attention_mask}
    if with_cache:
        kwargs[_first(_CACHE_NAMES, declared, "KV cache", fn)] = cache
        if "cache_position" in declared:
            kwargs["cache_position"] = cache_positions(hidden, cache)
    if position_ids is not None or "position_ids" in declared:
        kwargs["position_ids"] = position_ids
    return fn(**kwargs)


def masks_read_positions(model_cls: type) -> bool:
    """Whether ``model_cls`` builds its attention masks from the position ids it is given.

    BERT's ``_create_attention_masks`` declares ``position_ids`` from transformers 5.25 on (packed rows then
    attend only within their own sequence); a split passes the caller's positions to its masks exactly then.
    """
    method = getattr(model_cls, "_create_attention_masks", None)
    return method is not None and "position_ids" in _parameters(method)[0]


def takes_cache_position(layer: torch.nn.Module) -> bool:
    """Whether ``layer``'s forward declares ``cache_position`` (transformers releases before it was dropped)."""
    return "cache_position" in _parameters(type(layer).forward)[0]


def call_layer(layer: torch.nn.Module, hidden: torch.Tensor, *, cache: Any = None,
               cache_position: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """Run one decoder layer, passing the cache under its release's name; returns the hidden states.

    ``cache_position`` is passed only where the layer declares it (compute it once per part, before the
    first layer extends the cache: :func:`cache_positions`); a tuple output
    (GPT-2's block before the layers returned tensors) is reduced to its hidden states.
    """
    forward = type(layer).forward
    declared, var_kw = _parameters(forward)
    kwargs[_first(_CACHE_NAMES, declared, "KV cache", forward)] = cache
    if "cache_position" in declared:
        kwargs["cache_position"] = cache_position if cache_position is not None else cache_positions(hidden, cache)
    if not var_kw:
        kwargs = {k: v for k, v in kwargs.items() if k in declared}
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out

