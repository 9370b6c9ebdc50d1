"""Batched prefills: the first steps of several inference sessions as one trunk call.

Sessions that send their first step (the prompt) within the scheduler's batching window are run together:
their hidden states are concatenated along the batch, each session's rows RIGHT-padded to the longest prompt,
with a mask that is 0 on that padding and each row's own position ids. The trunk's layers are causal, so a real
position never sees a padded one: each session's output rows, and the keys and values its cache keeps (its rows,
its real positions, cut out of the batch's cache), are what the session computes alone, up to float rounding.

A cache layer with a sliding window keeps only its last positions; in a batch those would be the longest
prompt's, so sessions whose caches have sliding-window layers batch only while no prompt is longer than the
window keeps. Their prefills run one by one otherwise (:func:`batchable`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from splitfed.split.base import CutState
from splitfed.trunk.compute.recompute import busy_on_oom
from splitfed.trunk.inference.decodegroup import fill_layer, stored_positions

if TYPE_CHECKING:
    from splitfed.trunk.inference.sessions import Session

__all__ = ["batchable", "is_prefill", "prefill_key", "run_prefills"]

log = logging.getLogger(__name__)


def is_prefill(session: Session, state: CutState) -> bool:
    """Whether ``state`` is ``session``'s first step (its cache is empty and its own)."""
    return session.length == 0 and session.group is None and session.cache is not None and \
        state.hidden.dim() == 3 and state.hidden.shape[1] >= 1 and state.blocks is None


def prefill_key(state: CutState) -> tuple[Any, ...]:
    """Prefills with equal keys can share a trunk call (same width and dtype)."""
    return state.hidden.shape[2], state.hidden.dtype


def batchable(cache: Any, longest: int) -> bool:
    """Whether sessions with caches like ``cache`` can prefill together with prompts of up to ``longest``
    positions: every layer keeps all positions (full attention), or a sliding window keeps at least that many."""
    for layer in getattr(cache, "layers", None) or ():
        if type(layer) is DynamicSlidingWindowLayer:
            if stored_positions(layer, longest) < longest:
                return False
        elif type(layer) is not DynamicLayer:
            return False
    return True


def _inputs(states: list[CutState]) -> tuple[CutState, list[slice], list[int]]:
    """One right-padded batch from the prompts; each prompt's rows and length in it."""
    lengths = [int(st.hidden.shape[1]) for st in states]
    longest = max(lengths)
    rows, start = [], 0
    for st in states:
        rows.append(slice(start, start + st.hidden.shape[0]))
        start += st.hidden.shape[0]
    dtype = states[0].hidden.dtype
    device = states[0].hidden.device  # a prompt's hidden may arrive on the trunk's GPU (a region with CUDA events)
    if all(n == longest for n in lengths) and all(st.attention_mask is None and st.position_ids is None
                                                  for st in states):
        return CutState(torch.cat([st.hidden.to(device) for st in states])), rows, lengths
    hidden, masks, positions = [], [], []
    for st, n in zip(states, lengths):
        b, pad = st.hidden.shape[0], longest - n
        h = st.hidden.to(device=device, dtype=dtype)
        hidden.append(torch.cat([h, h.new_zeros(b, pad, h.shape[2])], dim=1) if pad else h)
        # mask and positions are built on the host (small); the runtime places them with the hidden state
        mask = torch.zeros(b, longest, dtype=torch.bool)
        mask[:, :n] = True if st.attention_mask is None else st.attention_mask.to(device="cpu", dtype=torch.bool)
        masks.append(mask)
        # as alone: the given positions, else 0..n-1; the padding continues them (it is masked out)
        own = torch.arange(n).unsqueeze(0) if st.position_ids is None else \
            st.position_ids.to(device="cpu", dtype=torch.long)
        own = own.expand(b, -1)
        if pad:
            own = torch.cat([own, own[:, -1:] + torch.arange(1, pad + 1)], dim=1)
        positions.append(own)
    return CutState(torch.cat(hidden), torch.cat(masks), torch.cat(positions)), rows, lengths


def run_prefills(runtime: Any, sessions: list[Session], states: list[CutState]) -> list[torch.Tensor]:
    """One trunk call for the sessions' first steps; each session's cache is set to what its prompt left.

    Returns each session's output (its rows, its positions) as the runtime hands it. The caller holds every
    session's step lock and has admitted the steps. On an error nothing changed: every session's cache is
    still empty.
    """
    from splitfed.trunk.inference.decoding import evaluating

    rt = runtime
    batch, rows, lengths = _inputs(states)
    cache = rt.trunk.new_cache()
    with rt._lock:
        inputs, _ = rt._prepare(batch, train=False)
        with evaluating(rt.trunk), torch.no_grad(), rt._autocast(), rt._stepwise(), \
                busy_on_oom("batched prefill"):
            out = rt.trunk(inputs, cache=cache, use_cache=True).hidden
    handed = rt.handed(out)
    outputs: list[torch.Tensor] = []
    for session, r, n in zip(sessions, rows, lengths):
        own = rt.trunk.new_cache()
        for layer, mine in zip(cache.layers, own.layers):
            keep = stored_positions(mine, n)
            # clone: a view would keep the whole batch's tensor alive
            fill_layer(mine, layer.keys[r, :, n - keep:n].clone(), layer.values[r, :, n - keep:n].clone(), n)
        session.cache = own
        outputs.append(handed[r, :n].contiguous())
    log.debug("prefilled %d sessions in one call (%d padded positions)", len(sessions), max(lengths))
    return outputs
