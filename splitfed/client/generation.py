"""Split generation: the client's bottom and top keep their KV caches, the trunk's cache lives on the server.

Each step sends only the new positions' hidden states, the 2-D padding mask
over every position so far, and the new positions' ids; the server extends its
cache and answers with the new positions' trunk output. Greedy decoding gives
token for token what the unsplit model's ``generate(do_sample=False)`` gives.

    with RemoteSession(client, max_length=64) as session:
        ids = generate(parts.bottom, session, parts.top, input_ids, max_new_tokens=32)

``generate`` also takes a :class:`~splitfed.channel.client.trunk.TrunkClient` (it
opens and closes a session itself) or, in local mode, the trunk module.

A :class:`RemoteSession` keeps what it sent (the bottom's output at every
position, the mask and the positions). When the server has lost the session
(restart, idle eviction: NOT_FOUND), it opens a new one, replays that history
as one prefill and goes on, so the generated tokens do not change.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from splitfed.client.decoding import FixedDecoder, decoder_kind, device_of
from splitfed.errors import ChannelError, ConfigError
from splitfed.split.base import CutState
from splitfed.split.transformer import left_padded_positions

if TYPE_CHECKING:  # the channel is only a type here: this module imports no gRPC code
    from splitfed.channel.client.trunk import TrunkClient

log = logging.getLogger(__name__)

#: Called with the tokens of each new position, shape (batch,), in order.
Streamer = Callable[[torch.Tensor], None]


@runtime_checkable
class TrunkSession(Protocol):
    """A trunk that keeps its KV cache between steps (remote or local)."""

    max_length: int
    length: int

    def step(self, state: CutState) -> torch.Tensor:
        """Run the trunk on the new positions of ``state``; return their output hidden states."""

    def reset(self) -> None:
        """Start over with an empty cache."""


class LocalSession:
    """The trunk in this process with its own ``DynamicCache`` (tests, single-machine use).

    Args:
        trunk: a trunk part with ``new_cache()``, or a ``TrunkRuntime`` (steps then
            run under its lock, so they never overlap an optimizer step).
        max_length: longest sequence the session may hold.
    """

    def __init__(self, trunk: Any, max_length: int) -> None:
        self._lock = getattr(trunk, "_lock", None)
        self.trunk: nn.Module = getattr(trunk, "trunk", trunk)
        if not callable(getattr(self.trunk, "new_cache", None)):
            raise ConfigError(f"{type(self.trunk).__name__} has no new_cache(); local generation needs a "
                              "transformer trunk part from split_model")
        self.max_length = max_length
        self.length = 0
        self.cache = self.trunk.new_cache()

    def step(self, state: CutState) -> torch.Tensor:
        """Extend the cache with the new positions; return their trunk output."""
        if self.length + state.hidden.shape[1] > self.max_length:
            raise ConfigError(f"the session holds at most {self.max_length} positions; open one with a larger "
                              "max_length")
        param = next(self.trunk.parameters(), None)
        if param is not None:
            move = (lambda t: None if t is None else t.to(param.device))
            state = CutState(state.hidden.to(param.device, param.dtype), move(state.attention_mask),
                             move(state.position_ids))
        with torch.no_grad(), self._lock if self._lock is not None else contextlib.nullcontext():
            out = self.trunk(state, cache=self.cache, use_cache=True).hidden
        self.length += state.hidden.shape[1]
        return out

    def reset(self) -> None:
        """Drop the cache."""
        self.cache, self.length = self.trunk.new_cache(), 0

    def close(self) -> None:
        """Drop the cache (nothing to release remotely)."""
        self.reset()

    def __enter__(self) -> LocalSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteSession:
    """An inference session on a trunk server: the server holds the trunk's KV cache.

    Use it as a context manager (the session closes on exit). The session keeps
    what it sent so that, when the server answers NOT_FOUND (restarted, or the
    session was evicted), it opens a new session and replays the sequence so far.

    Args:
        client: a :class:`~splitfed.channel.client.trunk.TrunkClient`.
        max_length: longest sequence (prompt and generated positions) the session holds.
        batch_size: sequences generated together.
        max_reopens: consecutive reopen-and-replay attempts before giving up.
    """

    def __init__(self, client: TrunkClient, max_length: int, batch_size: int = 1, *, max_reopens: int = 3) -> None:
        self.client = client
        self.max_length = max_length
        self.batch_size = batch_size
        self.max_reopens = max_reopens
        self.session_id = ""
        self.idle_ttl_s = 0.0
        self.length = 0
        self.reopened = 0  # sessions re-opened after the server lost one
        self._hidden: list[torch.Tensor] = []
        self._positions: list[torch.Tensor | None] = []

    def open(self) -> RemoteSession:
        """Open the server-side session (done by ``with``)."""
        self.session_id, self.idle_ttl_s = self.client.open_session(self.max_length, self.batch_size)
        log.debug("opened trunk session %s (idle TTL %.0f s)", self.session_id, self.idle_ttl_s)
        return self

    def close(self) -> None:
        """Close the server-side session and forget its history; a session the server already lost is fine."""
        self._hidden, self._positions, self.length = [], [], 0
        if not self.session_id:
            return
        try:
            self.client.close_session(self.session_id)
        except ChannelError as exc:
            if exc.code != "NOT_FOUND":
                log.warning("could not close trunk session %s: %s", self.session_id, exc)
        self.session_id = ""

    def reset(self) -> None:
        """Close this session and open a fresh one with an empty cache."""
        self.close()
        self.open()

    def step(self, state: CutState) -> torch.Tensor:
        """Send the new positions; return their trunk output (re-opening and replaying if the session was lost)."""
        if not self.session_id:
            self.open()
        self._hidden.append(state.hidden.detach())
        self._positions.append(state.position_ids)
        keep, total = state.hidden.shape[1], self.length + state.hidden.shape[1]
        if state.attention_mask is not None:  # one byte per position on the wire
            state = CutState(state.hidden, state.attention_mask.to(torch.bool), state.position_ids)
        send = state
        for attempt in range(self.max_reopens + 1):
            try:
                out, _ = self.client.forward(send, train=False, session_id=self.session_id)
                self.length = total
                return out[:, -keep:].clone()  # decoded replies are views of the received bytes
            except ChannelError as exc:
                if exc.code != "NOT_FOUND" or attempt == self.max_reopens:
                    raise
                log.warning("trunk session %s was lost (%s); opening a new one and replaying %d positions",
                            self.session_id, exc.code, total)
                self.session_id = ""
                self.open()
                self.reopened += 1
                positions = None if any(p is None for p in self._positions) else torch.cat(self._positions, 1)
                send = CutState(torch.cat(self._hidden, dim=1), state.attention_mask, positions)
        raise AssertionError("unreachable")  # pragma: no cover

    def __enter__(self) -> RemoteSession:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _token_set(*groups: int | Iterable[int] | None) -> set[int]:
    out: set[int] = set()
    for group in groups:
        if group is None:
            continue
        out.update([int(group)] if isinstance(group, int) else (int(t) for t in group))
    return out


def pick_tokens(logits: torch.Tensor, *, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next tokens from last-position logits (batch, vocab): argmax when ``temperature <= 0``, else sampled.

    Sampling applies temperature, then top-k, then top-p (nucleus), in the
    order ``transformers`` applies its logits warpers.
    """
    scores = logits.float()
    if temperature <= 0:
        return scores.argmax(dim=-1)
    scores = scores / temperature
    if top_k is not None and 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - top_p
        drop[..., -1:] = False  # always keep the most likely token
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _as_session(trunk: Any, max_length: int, batch_size: int) -> tuple[Any, bool]:
    """A session over ``trunk`` and whether ``generate`` owns (and must close) it."""
    if isinstance(trunk, TrunkSession):
        if trunk.max_length < max_length:
            raise ConfigError(f"the session holds {trunk.max_length} positions but prompt and new tokens need "
                              f"{max_length}; open it with max_length >= {max_length}")
        if getattr(trunk, "batch_size", batch_size) != batch_size:
            raise ConfigError(f"the session was opened for a batch of {trunk.batch_size}, the prompt has "
                              f"{batch_size} rows; open it with batch_size={batch_size}")
        if trunk.length:
            trunk.reset()
        return trunk, False
    if callable(getattr(trunk, "open_session", None)):
        return RemoteSession(trunk, max_length, batch_size).open(), True
    return LocalSession(trunk, max_length), True


@torch.no_grad()
def generate(bottom: nn.Module, trunk: TrunkSession | TrunkClient | nn.Module, top: nn.Module,
             input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             stop_token_ids: Sequence[int] = (), eos_token_id: int | Sequence[int] | None = None,
             pad_token_id: int | None = None, streamer: Streamer | None = None,
             seed: int | None = None, decode_steps: str = "auto") -> torch.Tensor:
    """Generate up to ``max_new_tokens`` per sequence with the split model; returns prompt + new tokens.

    Args:
        bottom, top: the client's parts; each keeps its own KV cache here.
        trunk: a session (:class:`RemoteSession`, :class:`LocalSession`), a
            ``TrunkClient`` (a session is opened and closed around the call) or,
            in local mode, the trunk part itself.
        input_ids: (batch, length) prompt token ids; batches are LEFT-padded.
        attention_mask: (batch, length), 0 on padding (default: all ones).
        temperature: 0 is greedy (token for token what the unsplit model's
            ``generate(do_sample=False)`` gives); above 0 samples.
        top_k, top_p: sampling filters.
        stop_token_ids, eos_token_id: a sequence ends after emitting one of these
            (it is kept in the output); later positions get ``pad_token_id``.
        pad_token_id: filler after a sequence ended (default: the first EOS, else 0).
        streamer: called with each step's new tokens, shape (batch,), in order.
        seed: seeds the sampler's own generator (reproducible sampling).
        decode_steps: how the bottom and the top step after the prompt (:mod:`splitfed.client.decoding`):
            ``"auto"`` (the default: CUDA graphs over fixed-size caches where the parts are on a GPU and qualify,
            for 8 new tokens or more, else the parts' growing caches), ``"dynamic"`` (always the growing caches),
            ``"graphs"`` or ``"fixed"`` (fixed-size caches without graphs, any device).

    Returns:
        (batch, length + n) token ids, n <= ``max_new_tokens`` (fewer when every
        sequence stopped early), as ``transformers`` returns them.
    """
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ConfigError(f"input_ids must be (batch, length) with length >= 1, got {list(input_ids.shape)}")
    device = device_of(bottom)
    ids = input_ids.to(device)
    batch, prompt_len = ids.shape
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(device=device, dtype=torch.long)
    if mask.shape != ids.shape:
        raise ConfigError(f"attention_mask {list(mask.shape)} must match input_ids {list(ids.shape)}")
    eos = _token_set(eos_token_id)
    stops = eos | _token_set(stop_token_ids)
    if pad_token_id is None:
        first = eos_token_id if isinstance(eos_token_id, int) or eos_token_id is None else next(iter(eos_token_id))
        pad_token_id = int(first) if first is not None else 0
    stop_ids = torch.tensor(sorted(stops), dtype=torch.long, device=device)
    top_device = device_of(top)
    generator = None
    if seed is not None and temperature > 0:
        generator = torch.Generator(device=top_device).manual_seed(seed)

    kind = decoder_kind(bottom, top, decode_steps, max_new_tokens)
    session, owned = _as_session(trunk, prompt_len + max_new_tokens, batch)
    bottom_cache, top_cache = bottom.new_cache(), top.new_cache()
    # Without padding every part takes its positions from its own cache's length and attends to everything so far,
    # exactly as with an all-ones mask: no mask or positions are built, checked on the host or sent at each step
    # (on a GPU each of those is a host wait).
    padded = not bool(mask.all())
    positions = left_padded_positions(mask) if padded else None
    step_ids = ids
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    new_tokens: list[torch.Tensor] = []
    decoder: FixedDecoder | None = None
    try:
        for step in range(max_new_tokens):
            if decoder is not None:  # after the prompt: fixed-size caches (CUDA graphs on a GPU)
                hidden = decoder.bottom_step(step_ids)
                hidden = session.step(CutState(hidden, mask, positions) if padded else CutState(hidden))
                last = decoder.top_step(hidden)
            else:
                state = bottom(step_ids, attention_mask=mask if padded else None, position_ids=positions,
                               cache=bottom_cache, use_cache=True)
                hidden = session.step(state if padded else CutState(state.hidden))
                hidden = hidden.to(top_device, state.hidden.dtype)
                state = (CutState(hidden, mask.to(top_device),
                                  None if state.position_ids is None else state.position_ids.to(top_device))
                         if padded else CutState(hidden))
                last = top(state, cache=top_cache, use_cache=True)[:, -1, :]
                if kind is not None:
                    following = (positions[:, -1:] if padded else torch.full((batch, 1), prompt_len - 1,
                                                                            device=device)) + 1
                    decoder = FixedDecoder(bottom, top, bottom_cache, top_cache, mask, following,
                                           prompt_len + max_new_tokens, graphs=kind == "graphs")
            tokens = pick_tokens(last, temperature=temperature, top_k=top_k, top_p=top_p,
                                 generator=generator).to(device)
            tokens = torch.where(unfinished, tokens, torch.full_like(tokens, pad_token_id))
            new_tokens.append(tokens)
            if streamer is not None:
                streamer(tokens)
            if stops:
                unfinished &= ~torch.isin(tokens, stop_ids)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("generation step %d: %s", step, tokens.tolist())
            if stops and not bool(unfinished.any()):  # without stop tokens every sequence runs to the end
                break
            step_ids = tokens[:, None]
            if padded:
                mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
                positions = positions[:, -1:] + 1
    finally:
        if owned:
            session.close()
    return torch.cat([ids, torch.stack(new_tokens, dim=1)], dim=1)
