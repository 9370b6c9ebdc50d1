"""Error feedback: what compression left out is kept per sender and added to its next tensor of the same kind.

:class:`ErrorFeedback` holds one sender's residuals (a client); :class:`FeedbackStore` those of many
clients (the trunk server), bounded in clients and bytes, with each client's last reply kept for retries.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from splitfed.codec.compression.packed import Packed, compress, decompress
from splitfed.codec.compression.spec import CompressionSpec


# -- error feedback ----------------------------------------------------------------------
def compress_with_feedback(x: torch.Tensor, spec: CompressionSpec, dtype: torch.dtype | None,
                           residual: torch.Tensor | None) -> tuple[Packed, torch.Tensor | None]:
    """Compress ``x + residual``; returns the packed tensor and the new residual (None without feedback).

    A residual of another shape (a smaller last batch) or on another device is not added; the new
    residual is that of ``x`` alone then.
    """
    if not spec.error_feedback:
        return compress(x, spec, dtype), None
    target = x.detach().float()
    if residual is not None and residual.shape == target.shape and residual.device == target.device:
        target = target + residual
    packed = compress(target, spec, dtype or x.dtype)
    return packed, target - decompress(packed).float()


class ErrorFeedback:
    """One sender's residuals, by tensor kind (``grad`` at the client's cut)."""

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def compress(self, key: str, x: torch.Tensor, spec: CompressionSpec,
                 dtype: torch.dtype | None = None) -> tuple[Packed, Any]:
        """Compress ``x`` with the residual of ``key``; pass the returned token to :meth:`commit` once sent."""
        with self._lock:
            residual = self._residuals.get(key)
        packed, new = compress_with_feedback(x, spec, dtype, residual)
        return packed, (key, new)

    def commit(self, token: Any) -> None:
        """Keep the residual of a tensor that was delivered."""
        key, residual = token
        if residual is None:
            return
        with self._lock:
            self._residuals[key] = residual

    def residual(self, key: str) -> torch.Tensor | None:
        """The residual kept for ``key`` (None if none)."""
        with self._lock:
            return self._residuals.get(key)

    def reset(self) -> None:
        """Forget every residual."""
        with self._lock:
            self._residuals.clear()

    @property
    def nbytes(self) -> int:
        """Bytes held in residuals."""
        with self._lock:
            return sum(r.numel() * r.element_size() for r in self._residuals.values())


@dataclass
class _ClientFeedback:
    residuals: dict[str, torch.Tensor] = field(default_factory=dict)
    last_id: str = ""
    last_reply: Any = None
    touched: float = 0.0

    @property
    def nbytes(self) -> int:
        held = sum(r.numel() * r.element_size() for r in self.residuals.values())
        reply = self.last_reply
        return held + int(reply.nbytes if isinstance(reply, Packed) else getattr(reply, "wire_nbytes", 0))


class FeedbackStore:
    """Error-feedback residuals of many clients (the trunk server's replies), bounded.

    Holds at most ``max_clients`` clients and ``max_bytes`` of residuals and kept replies (the
    least recently used client goes first); a client idle for ``ttl_s`` is
    dropped, and :meth:`drop` forgets a client that leaves. Each client also
    keeps its last reply by request id, so that a retried request is answered
    with the same bytes instead of applying the feedback twice.
    """

    def __init__(self, max_clients: int = 1024, max_bytes: int = 256 << 20, ttl_s: float = 900.0) -> None:
        self.max_clients = max_clients
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clients: OrderedDict[str, _ClientFeedback] = OrderedDict()
        self._lock = threading.Lock()
        self.evictions = 0

    def _entry(self, client: str, now: float) -> _ClientFeedback:
        entry = self._clients.get(client)
        if entry is None or now - entry.touched > self.ttl_s:
            entry = _ClientFeedback()
            self._clients[client] = entry
        entry.touched = now
        self._clients.move_to_end(client)
        return entry

    def compress(self, client: str, request_id: str, key: str, x: torch.Tensor, spec: CompressionSpec,
                 dtype: torch.dtype | None, build: Any = None) -> Any:
        """Compress ``x`` for ``client`` with its residual of ``key``; ``build(packed)`` makes the reply.

        A second call with the same ``request_id`` (a retry) returns the first
        reply unchanged. Returns ``build(packed)`` (or the packed tensor).
        """
        now = time.monotonic()
        with self._lock:
            entry = self._entry(client, now)
            if request_id and entry.last_id == request_id:
                return entry.last_reply
            residual = entry.residuals.get(key)
        packed, new = compress_with_feedback(x, spec, dtype, residual)
        reply = build(packed) if build is not None else packed
        with self._lock:
            entry = self._entry(client, now)
            if new is not None:
                entry.residuals[key] = new
            entry.last_id, entry.last_reply = request_id, reply
            self._evict(now)
        return reply

    def _evict(self, now: float) -> None:
        for client in [c for c, e in self._clients.items() if now - e.touched > self.ttl_s]:
            del self._clients[client]
            self.evictions += 1
        total = sum(e.nbytes for e in self._clients.values())
        while self._clients and (len(self._clients) > self.max_clients or total > self.max_bytes):
            _, entry = self._clients.popitem(last=False)
            total -= entry.nbytes
            self.evictions += 1

    def residual(self, client: str, key: str) -> torch.Tensor | None:
        """The residual kept for ``client`` and ``key`` (None if none)."""
        with self._lock:
            entry = self._clients.get(client)
            return None if entry is None else entry.residuals.get(key)

    def drop(self, client: str) -> None:
        """Forget ``client`` (it left the step group)."""
        with self._lock:
            self._clients.pop(client, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._clients)

    @property
    def nbytes(self) -> int:
        """Bytes held in residuals."""
        with self._lock:
            return sum(e.nbytes for e in self._clients.values())


__all__ = ["ErrorFeedback", "FeedbackStore", "compress_with_feedback"]
