"""Inference sessions: one client's server-side KV cache of the trunk, bounded in number, bytes and idle time.

Pure torch: the gRPC servicer routes ``OpenSession`` to :meth:`SessionManager.open`,
``CloseSession`` to :meth:`SessionManager.close`, a ``Forward`` that names a
session to :meth:`SessionManager.step`, and its janitor calls
:meth:`SessionManager.sweep`.

A session holds ``trunk.new_cache()`` for one client. Each step sends only the
new positions' hidden states (plus the 2-D padding mask over every position
so far and the new positions' ids); the trunk extends the cache and returns the
new positions' output. Steps compute under the runtime's lock, so inference
never runs while the optimizer changes the weights.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from splitfed.errors import (
    ConfigError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SessionNotFoundError,
    TensorValueError,
)
from splitfed.split.base import CutState
from splitfed.split.transformer import BERT_FAMILY
from splitfed.trunk.inference.decoding import MAX_MISSED, SessionStep, evaluating, step_many
from splitfed.trunk.inference.fixedsteps import check_decode_steps, chosen
from splitfed.trunk.compute.runtime import TrunkRuntime

log = logging.getLogger(__name__)

_TOMBSTONES = 1024  # ids of ended sessions remembered, to say why a later step fails


@dataclass(frozen=True)
class SessionLimits:
    """Bounds on inference sessions.

    Args:
        max_sessions: sessions open at once, all clients together.
        max_cache_bytes: KV-cache bytes all sessions may hold together. A session
            reserves its worst case (``batch_size x max_length`` positions) when it
            opens, so a running session never runs out of room.
        idle_ttl_s: seconds without a step after which a session is evicted.
        max_length: longest sequence one session may ask for.
        max_sessions_per_client: sessions one client may hold at once, so that no client
            can take every session.
        decode_steps: how decode steps run: ``"auto"`` (CUDA graphs on a GPU, the growing cache
            elsewhere), ``"graphs"``, ``"fixed"`` or ``"dynamic"`` (:mod:`splitfed.trunk.inference.fixedsteps`).
    """

    max_sessions: int = 64
    max_cache_bytes: int = 2 << 30
    idle_ttl_s: float = 300.0
    max_length: int = 1 << 16
    max_sessions_per_client: int = 8
    decode_steps: str = "auto"

    def __post_init__(self) -> None:
        check_decode_steps(self.decode_steps)
        if (self.max_sessions < 1 or self.max_cache_bytes < 1 or self.idle_ttl_s <= 0 or self.max_length < 1
                or self.max_sessions_per_client < 1):
            raise ConfigError("session limits must be positive: max_sessions, max_cache_bytes, idle_ttl_s, "
                              "max_length, max_sessions_per_client")


@dataclass
class Session:
    """One client's KV cache of the trunk and where its sequence stands."""

    session_id: str
    client_id: str
    max_length: int
    batch_size: int
    reserved_bytes: int
    cache: Any
    last_used: float
    length: int = 0  # positions the cache has seen
    steps: int = 0
    last_step: tuple[str, int, torch.Tensor] | None = None  # (step id, length before, output) for retries
    group: Any = None  # the DecodeGroup holding this session's cache (``cache`` is then None)
    window: int = 0  # the batching window its last step ran in (0: none yet; see SessionManager.complete)
    lock: threading.Lock = field(default_factory=threading.Lock)


def supports_sessions(trunk: Any) -> bool:
    """Whether ``trunk`` can hold a KV cache: it has ``new_cache()`` and is a decoder (not BERT)."""
    if not callable(getattr(trunk, "new_cache", None)):
        return False
    config = getattr(trunk, "config", None)
    return getattr(config, "model_type", None) not in BERT_FAMILY


def cache_bytes(cache: Any) -> int:
    """Bytes held by a cache's key and value tensors (``DynamicCache`` and anything with ``layers``)."""
    total = 0
    for layer in getattr(cache, "layers", ()) or ():
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def kv_bytes_per_position(trunk: Any, dtype: torch.dtype) -> int | None:
    """Worst-case cache bytes one position adds across the trunk's layers, from its config (None if unknown)."""
    cfg = getattr(trunk, "config", None)
    layers = getattr(trunk, "layers", None)
    try:
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        count = len(layers) if layers is not None else int(cfg.num_hidden_layers)
    except (AttributeError, TypeError, ValueError):
        return None
    return 2 * count * kv_heads * head_dim * dtype.itemsize


class SessionManager:
    """Inference sessions on a trunk: open, step, close, and evict when idle.

    Args:
        runtime: the trunk runtime; steps run its trunk under its lock.
        max_sessions, max_cache_bytes, idle_ttl_s, max_length, max_sessions_per_client: see
            :class:`SessionLimits`.
        clock: seconds, monotonic (injected by tests).
        decode_steps: how batched decode steps run: ``"auto"`` (CUDA graphs on a GPU), ``"graphs"``, ``"fixed"``
            or ``"dynamic"`` (:mod:`splitfed.trunk.inference.fixedsteps`).
    """

    def __init__(self, runtime: TrunkRuntime, *, max_sessions: int = SessionLimits.max_sessions,
                 max_cache_bytes: int = SessionLimits.max_cache_bytes,
                 idle_ttl_s: float = SessionLimits.idle_ttl_s, max_length: int = SessionLimits.max_length,
                 max_sessions_per_client: int = SessionLimits.max_sessions_per_client,
                 clock: Callable[[], float] = time.monotonic, decode_steps: str = "auto") -> None:
        self.limits = SessionLimits(max_sessions, max_cache_bytes, idle_ttl_s, max_length, max_sessions_per_client,
                                    decode_steps)
        self.runtime = runtime
        self.decode_steps = decode_steps
        if decode_steps == "graphs" and runtime.device.type != "cuda":
            raise ConfigError(f"decode_steps='graphs' needs a trunk on a GPU, not on {runtime.device}; "
                              "use 'auto' or 'fixed'")
        #: whether decode groups take fixed steps (then a lone decoding session is a group of one)
        self.fixed_steps = chosen(runtime, decode_steps) is not None
        self.clock = clock
        # Under autocast the cache is in the (narrower) autocast dtype: the weights' dtype is the worst case.
        self._per_position = kv_bytes_per_position(runtime.trunk, runtime.dtype)
        self._sessions: dict[str, Session] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        self._windows = 0  # batching windows run so far (calls of run_many)
        self.stats: dict[str, int] = {"opened": 0, "closed": 0, "evicted_idle": 0, "refused": 0, "steps": 0,
                                      "retried_steps": 0, "batched_steps": 0, "decode_batches": 0,
                                      "decode_groups": 0, "prefill_batches": 0, "batched_prefills": 0,
                                      "fixed_steps": 0, "graph_captures": 0}

    @classmethod
    def from_limits(cls, runtime: TrunkRuntime, limits: SessionLimits = SessionLimits()) -> SessionManager:
        """A manager with the bounds and the decode steps of a :class:`SessionLimits`."""
        return cls(runtime, max_sessions=limits.max_sessions, max_cache_bytes=limits.max_cache_bytes,
                   idle_ttl_s=limits.idle_ttl_s, max_length=limits.max_length,
                   max_sessions_per_client=limits.max_sessions_per_client, decode_steps=limits.decode_steps)

    # -- bookkeeping -----------------------------------------------------------------
    @property
    def bytes_held(self) -> int:
        """KV-cache bytes all open sessions hold now, measured from their key and value tensors."""
        with self._lock:
            sessions = list(self._sessions.values())
        groups = {id(s.group): s.group for s in sessions if s.group is not None}
        return sum(cache_bytes(s.cache) for s in sessions) + sum(cache_bytes(g.cache) for g in groups.values())

    @property
    def bytes_reserved(self) -> int:
        """Bytes reserved by open sessions for their worst case."""
        with self._lock:
            return sum(s.reserved_bytes for s in self._sessions.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def _end(self, session_id: str, why: str) -> Session | None:
        """Drop a session (caller holds ``_lock``) and remember why."""
        session = self._sessions.pop(session_id, None)
        if session is not None and session.group is not None:
            session.group.dissolve()  # the other members take their caches back
        self._ended[session_id] = why
        while len(self._ended) > _TOMBSTONES:
            self._ended.popitem(last=False)
        return session

    def _get(self, client_id: str, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            why = self._ended.get(session_id, "is unknown (the server may have restarted)")
            raise SessionNotFoundError(f"inference session {session_id!r} {why}; open a new session and replay "
                                       "the sequence so far (splitfed.client.generation.generate does this by itself)")
        if session.client_id != client_id:
            raise PermissionDeniedError(f"inference session {session_id!r} belongs to another client; open "
                                        "your own session")
        return session

    # -- the servicer's interface ------------------------------------------------------
    def open(self, client_id: str, *, max_length: int, batch_size: int = 1) -> tuple[str, float]:
        """Open a session for ``batch_size`` sequences of up to ``max_length`` positions; returns (id, idle TTL)."""
        if not 0 < max_length <= self.limits.max_length:
            raise TensorValueError(f"max_length must be between 1 and {self.limits.max_length}, got {max_length}")
        if batch_size < 1:
            raise TensorValueError(f"batch_size must be at least 1, got {batch_size}")
        reserve = (self._per_position or 0) * max_length * batch_size
        with self._lock:
            if len(self._sessions) >= self.limits.max_sessions:
                self.stats["refused"] += 1
                raise ResourceExhaustedError(
                    f"the trunk server holds its maximum of {self.limits.max_sessions} inference sessions; close "
                    "sessions you no longer use, or retry once idle ones expire "
                    f"(after {self.limits.idle_ttl_s:g} s)")
            mine = sum(1 for s in self._sessions.values() if s.client_id == client_id)
            if mine >= self.limits.max_sessions_per_client:
                self.stats["refused"] += 1
                raise ResourceExhaustedError(
                    f"client {client_id} already holds {mine} inference sessions, the most one client may; close "
                    "one before opening another")
            held = sum(s.reserved_bytes for s in self._sessions.values())
            if held + reserve > self.limits.max_cache_bytes:
                self.stats["refused"] += 1
                raise ResourceExhaustedError(
                    f"a session of {batch_size} x {max_length} positions needs {reserve} bytes of KV cache, but "
                    f"only {self.limits.max_cache_bytes - held} of {self.limits.max_cache_bytes} are free; ask for "
                    "a smaller max_length or batch, or retry later")
            session_id = uuid.uuid4().hex
            self._sessions[session_id] = Session(session_id, client_id, max_length, batch_size, reserve,
                                                 self.runtime.trunk.new_cache(), self.clock())
            self.stats["opened"] += 1
        log.debug("opened inference session %s for client %s (%d x %d positions, %d bytes reserved)",
                  session_id, client_id, batch_size, max_length, reserve)
        return session_id, float(self.limits.idle_ttl_s)

    def close(self, client_id: str, session_id: str) -> None:
        """Close a session and free its cache."""
        with self._lock:
            self._get(client_id, session_id)
            self._end(session_id, "was closed")
            self.stats["closed"] += 1
        log.debug("closed inference session %s of client %s", session_id, client_id)

    def step(self, client_id: str, session_id: str, state: CutState, *, step_id: str = "") -> torch.Tensor:
        """Run the trunk on the new positions of a session's sequence; returns their output hidden states.

        ``state.attention_mask``, when given, must cover every position so far
        (the cached ones and the new ones). A step repeated with the same
        ``step_id`` (the request's activation id: a retry whose reply was lost)
        gets the same answer again and leaves the cache as it was, with or
        without a mask.
        """
        session = self._touch(client_id, session_id)
        with session.lock:
            repeated = self._admit(session, state, step_id)
            if repeated is not None:
                return repeated
            if session.group is not None:  # stepping alone: the session takes its own cache back
                session.group.dissolve()
            out = self._compute(session, state)
            self._advance(session, state, step_id, out)
        self._settle(session)
        return out

    def _touch(self, client_id: str, session_id: str) -> Session:
        with self._lock:
            session = self._get(client_id, session_id)
            session.last_used = self.clock()
        return session

    def _admit(self, session: Session, state: CutState, step_id: str) -> torch.Tensor | None:
        """Check a step against its session (session lock held); the last answer again when it is a retry."""
        hidden, mask = state.hidden, state.attention_mask
        if hidden.dim() != 3 or hidden.shape[0] != session.batch_size:
            raise TensorValueError(f"session {session.session_id} was opened for a batch of {session.batch_size}; "
                                   f"got hidden of shape {list(hidden.shape)}")
        last = session.last_step
        if step_id and last is not None and last[0] == step_id:
            with self._lock:
                self.stats["retried_steps"] += 1
            log.debug("session %s: step repeated (retry); answering from the last step", session.session_id)
            return last[2]
        total = session.length + int(hidden.shape[1])
        if mask is not None and mask.shape[1] != total:
            raise TensorValueError(f"attention_mask covers {mask.shape[1]} positions, but session "
                                   f"{session.session_id} holds {session.length} and this step adds "
                                   f"{hidden.shape[1]}: send the mask over all positions so far")
        if total > session.max_length:
            raise TensorValueError(f"session {session.session_id} holds at most {session.max_length} positions and "
                                   f"this step would reach {total}; open a session with a larger max_length")
        return None

    @staticmethod
    def _advance(session: Session, state: CutState, step_id: str, out: torch.Tensor) -> None:
        new = int(state.hidden.shape[1])
        session.length, session.steps = session.length + new, session.steps + 1
        session.last_step = (step_id, session.length - new, out)

    def _settle(self, session: Session) -> None:
        """Count a step; without a per-position reservation, enforce the byte cap on what the caches hold."""
        if self._per_position is None and self.bytes_held > self.limits.max_cache_bytes:
            with self._lock:  # no reservation was possible: enforce the cap on what the caches hold
                self._end(session.session_id, "was dropped because the server's KV-cache memory was full")
                self.stats["refused"] += 1
            raise ResourceExhaustedError(f"the trunk server's KV caches exceed {self.limits.max_cache_bytes} bytes; "
                                         "session dropped: retry later with a shorter sequence")
        with self._lock:
            self.stats["steps"] += 1
            session.last_used = self.clock()

    def _compute(self, session: Session, state: CutState) -> torch.Tensor:
        rt = self.runtime
        with rt._lock:
            inputs, _ = rt._prepare(state, train=False)
            # eval mode: no dropout in inference; the lock keeps training out meanwhile
            with evaluating(rt.trunk), torch.no_grad(), rt._autocast(), rt._stepwise():
                return rt.trunk(inputs, cache=session.cache, use_cache=True).hidden

    # -- batched decoding (the scheduler's runner interface) -------------------------------
    def run_one(self, item: SessionStep) -> torch.Tensor:
        """One step alone, its output as the runtime hands it."""
        return self.runtime.handed(self.step(item.client_id, item.session_id, item.state, step_id=item.step_id))

    def run_many(self, items: list[SessionStep]) -> list[Any]:
        """Steps that arrived within the batching window: decode steps run as one call (:mod:`.decoding`)."""
        with self._lock:
            self._windows += 1
            for item in items:
                session = self._sessions.get(item.session_id)
                if session is not None and session.client_id == item.client_id:
                    session.window = self._windows
        return step_many(self, items)

    def complete(self, items: list[SessionStep]) -> bool:
        """Whether ``items`` hold a step of every session that is decoding now: the window may close.

        A session is decoding while it stepped in one of the last :data:`~splitfed.trunk.inference.decoding.MAX_MISSED`
        windows (whether its step batched or ran alone, e.g. a prefill). Waiting for all of them lets every
        session step in one call, and groups that split up merge again; a session whose client stopped (or is
        slow) is waited for only until the scheduler's bound, and no longer at all once it has sat out
        ``MAX_MISSED`` windows.
        """
        inside = {item.session_id for item in items}
        with self._lock:
            since = self._windows - MAX_MISSED
            return all(sid in inside for sid, s in self._sessions.items() if s.window > since) and any(
                s.window > since for s in self._sessions.values())

    def sweep(self) -> int:
        """Evict sessions idle for longer than the TTL; returns how many were evicted."""
        now = self.clock()
        with self._lock:
            stale = [s for s in self._sessions.values()
                     if now - s.last_used > self.limits.idle_ttl_s and not s.lock.locked()]
            for s in stale:
                self._end(s.session_id, f"was evicted after {self.limits.idle_ttl_s:g} s without a step")
            self.stats["evicted_idle"] += len(stale)
        for s in stale:
            log.info("evicted idle inference session %s of client %s (%d positions)", s.session_id, s.client_id,
                     s.length)
        return len(stale)

    def close_all(self, why: str) -> int:
        """Close every session (the model is going away); a later step on one is told ``why``. Returns how many."""
        with self._lock:
            ids = list(self._sessions)
            for session_id in ids:
                self._end(session_id, why)
            self.stats["closed"] += len(ids)
        if ids:
            log.info("closed %d inference sessions: they %s", len(ids), why)
        return len(ids)

    def describe(self) -> dict[str, int]:
        """Counters, open sessions and bytes held, for logs and metrics."""
        with self._lock:
            out = dict(self.stats, open=len(self._sessions))
        out["bytes_held"] = self.bytes_held
        return out
