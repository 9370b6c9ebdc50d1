"""Compression of what crosses a cut: blockwise absmax int8, top-k sparsification, error feedback.

Pure torch; knows nothing of bytes or gRPC (:mod:`splitfed.codec` turns a
:class:`Packed` tensor into bytes and back). Two compressors:

* **int8** (activations and gradients): the flattened tensor is cut into blocks
  of ``block_size`` elements; each block travels as one fp32 scale (its absolute
  maximum) and one int8 per element, ``round(x * 127 / scale)``. Decoding gives
  ``q * scale / 127``: the error of every element is at most ``scale / 254``.
* **topk** (gradients): the ``k = ceil(ratio * n)`` elements of largest
  magnitude travel with their flat positions; all others decode to zero.

**Error feedback** keeps, per sender and per tensor, what compression left out
(the residual ``x - decode(encode(x))``) and adds it to the next tensor of the
same kind before compressing it, so that nothing is lost for good: the sum of
what was transmitted over many steps tracks the sum of the true tensors.
:class:`ErrorFeedback` holds one sender's residuals (a client), :class:`FeedbackStore`
those of many clients (the trunk server), bounded in clients and bytes.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from splitfed.errors import CodecError, ConfigError

METHODS = ("none", "int8", "topk")
#: Compressors for activations (top-k of an activation would drop most of the example).
ACTIVATION_METHODS = ("none", "int8")
DEFAULT_BLOCK = 128
MAX_BLOCK = 1 << 20
#: Top-k positions travel as int32.
MAX_TOPK_ELEMENTS = (1 << 31) - 1
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class CompressionSpec:
    """How one kind of tensor is compressed.

    Args:
        method: ``none``, ``int8`` (blockwise absmax) or ``topk``.
        topk_ratio: fraction of the elements top-k keeps, in (0, 1].
        block_size: elements per int8 scale.
        error_feedback: carry the compression error into the next tensor of the same kind.
    """

    method: str = "none"
    topk_ratio: float = 0.01
    block_size: int = DEFAULT_BLOCK
    error_feedback: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"compression method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if not 0.0 < self.topk_ratio <= 1.0:
            raise ConfigError(f"topk-ratio must be in (0, 1], got {self.topk_ratio}")
        if not 0 < self.block_size <= MAX_BLOCK:
            raise ConfigError(f"int8 block size must be in 1..{MAX_BLOCK}, got {self.block_size}")

    @property
    def active(self) -> bool:
        """Whether tensors are compressed at all."""
        return self.method != "none"

    def topk_count(self, numel: int) -> int:
        """Elements top-k keeps of ``numel``: ``ceil(ratio * numel)``, at least one."""
        return min(numel, max(1, math.ceil(self.topk_ratio * numel)))


@dataclass(frozen=True)
class WireCompression:
    """What a client compresses at the cut: activations (int8) and gradients (int8 or top-k).

    ``activations`` applies to the hidden state a client sends and the trunk's
    output the server returns; ``gradients`` to the gradient a client sends and
    the input gradient the server returns. Each side compresses what it sends;
    error feedback (``gradients.error_feedback``) is kept by each side for what
    it sends. Activations never carry error feedback: an activation's error
    belongs to its own batch.
    """

    activations: CompressionSpec = field(default_factory=CompressionSpec)
    gradients: CompressionSpec = field(default_factory=CompressionSpec)

    def __post_init__(self) -> None:
        if self.activations.method not in ACTIVATION_METHODS:
            raise ConfigError(f"activations can be compressed with {', '.join(ACTIVATION_METHODS)}, not "
                              f"{self.activations.method!r}; top-k applies to gradients (wire-compression-grad)")

    @classmethod
    def of(cls, value: WireCompression | str | None, *, grad: str = "", act: str = "", topk_ratio: float = 0.01,
           block_size: int = DEFAULT_BLOCK, error_feedback: bool = True) -> WireCompression:
        """Build from a name: ``int8`` compresses both directions; ``topk`` gradients only (activations raw).

        ``act`` and ``grad`` (non-empty) override the method for activations and gradients.
        """
        if isinstance(value, WireCompression):
            return value
        name = value or "none"
        if name not in METHODS:
            raise ConfigError(f"wire-compression must be one of {', '.join(METHODS)}; got {name!r}")
        act_method = act or ("none" if name == "topk" else name)
        grad_method = grad or name
        return cls(CompressionSpec(act_method, topk_ratio, block_size, error_feedback=False),
                   CompressionSpec(grad_method, topk_ratio, block_size, error_feedback))

    def describe(self) -> str:
        """A short description for logs: ``activations int8, gradients topk 0.01 (error feedback)``."""
        def one(spec: CompressionSpec) -> str:
            return f"topk {spec.topk_ratio:g}" if spec.method == "topk" else spec.method
        ef = " (error feedback)" if self.gradients.active and self.gradients.error_feedback else ""
        return f"activations {one(self.activations)}, gradients {one(self.gradients)}{ef}"


@dataclass(frozen=True)
class Packed:
    """A compressed tensor: what the receiver needs to rebuild it.

    ``payload`` holds one int8 per element (int8) or the kept values (top-k);
    ``scales`` one fp32 per block (int8); ``indices`` the kept flat positions,
    int32 and strictly increasing (top-k).
    """

    method: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    payload: torch.Tensor
    scales: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    block_size: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of payload, scales and indices."""
        return sum(t.numel() * t.element_size() for t in (self.payload, self.scales, self.indices) if t is not None)


# -- int8 ------------------------------------------------------------------------------
def quantize_int8(x: torch.Tensor, block_size: int = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax int8 of ``x`` flattened: ``(q, scales)``, q int8 per element, one fp32 scale per block."""
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    blocks = math.ceil(n / block_size)
    if blocks * block_size != n:
        flat = torch.nn.functional.pad(flat, (0, blocks * block_size - n))
    view = flat.view(blocks, block_size)
    scales = view.abs().amax(dim=1)
    inv = torch.where(scales > 0, 127.0 / scales, torch.zeros_like(scales))
    q = (view * inv[:, None]).round_().clamp_(-127, 127).to(torch.int8).reshape(-1)
    return (q[:n] if q.numel() != n else q), scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, block_size: int, shape: tuple[int, ...],
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale / 127`` per block, shaped ``shape`` in ``dtype`` (inputs as :func:`quantize_int8` gives)."""
    n = q.numel()
    full = n // block_size
    out = torch.empty(n, dtype=torch.float32, device=q.device)
    step = scales.float() / 127.0
    if full:
        torch.mul(q[:full * block_size].view(full, block_size), step[:full, None],
                  out=out[:full * block_size].view(full, block_size))
    if full * block_size != n:
        torch.mul(q[full * block_size:], step[full], out=out[full * block_size:])
    return out.view(shape).to(dtype)


# -- top-k -----------------------------------------------------------------------------
def topk_sparsify(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` elements of ``x`` of largest magnitude: ``(indices, values)``, int32 flat positions ascending."""
    flat = x.detach().reshape(-1)
    if flat.numel() > MAX_TOPK_ELEMENTS:
        raise ConfigError(f"top-k handles tensors of at most {MAX_TOPK_ELEMENTS} elements; use int8 instead")
    idx = flat.abs().float().topk(k, sorted=False).indices.sort().values
    return idx.to(torch.int32), flat[idx]


def densify(indices: torch.Tensor, values: torch.Tensor, shape: tuple[int, ...],
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Zeros of ``shape`` with ``values`` at the flat ``indices``."""
    out = torch.zeros(math.prod(shape), dtype=dtype, device=values.device)
    out[indices.long()] = values.to(dtype)
    return out.view(shape)


# -- packing -----------------------------------------------------------------------------
def compress(x: torch.Tensor, spec: CompressionSpec, dtype: torch.dtype | None = None) -> Packed:
    """Compress ``x`` (floating) as ``spec`` says; the receiver decodes it to ``dtype`` (default ``x.dtype``)."""
    if not x.is_floating_point():
        raise ConfigError(f"only floating tensors are compressed, got {x.dtype}")
    dtype = dtype or x.dtype
    shape = tuple(x.shape)
    if spec.method == "int8":
        q, scales = quantize_int8(x, spec.block_size)
        return Packed("int8", shape, dtype, q, scales=scales, block_size=spec.block_size)
    if spec.method == "topk":
        idx, values = topk_sparsify(x, spec.topk_count(x.numel()))
        return Packed("topk", shape, dtype, values.to(dtype), indices=idx)
    raise ConfigError(f"nothing to compress with method {spec.method!r}")


def decompress(packed: Packed) -> torch.Tensor:
    """The tensor a :class:`Packed` stands for (checked inputs; see :func:`check_packed`)."""
    if packed.method == "int8":
        assert packed.scales is not None
        return dequantize_int8(packed.payload, packed.scales, packed.block_size, packed.shape, packed.dtype)
    assert packed.indices is not None
    return densify(packed.indices, packed.payload, packed.shape, packed.dtype)


def check_packed(name: str, packed: Packed) -> None:
    """Refuse a received :class:`Packed` whose parts do not fit together; raises :class:`CodecError`.

    Checks scale and value counts, finite non-negative scales, finite values,
    and top-k positions in range and strictly increasing (no duplicates).
    """
    numel = math.prod(packed.shape)
    if packed.method == "int8":
        scales = packed.scales
        assert scales is not None
        blocks = math.ceil(numel / packed.block_size)
        if scales.numel() != blocks:
            raise CodecError(f"tensor {name!r}: int8 payload of {numel} elements in blocks of {packed.block_size} "
                             f"needs {blocks} scales, got {scales.numel()}")
        if packed.payload.numel() != numel:
            raise CodecError(f"tensor {name!r}: int8 payload holds {packed.payload.numel()} values for shape "
                             f"{list(packed.shape)} ({numel} elements)")
        if blocks and not bool((scales >= 0).all() & torch.isfinite(scales).all()):
            raise CodecError(f"tensor {name!r}: int8 scales must be finite and >= 0; the sender must not "
                             "quantize NaN or Inf values")
        return
    indices = packed.indices
    assert indices is not None
    k = indices.numel()
    if packed.payload.numel() != k:
        raise CodecError(f"tensor {name!r}: top-k carries {packed.payload.numel()} values for {k} indices; send "
                         "one value per index")
    if k > numel:
        raise CodecError(f"tensor {name!r}: top-k keeps {k} of {numel} elements")
    if k == 0:
        return
    low, high = int(indices.min()), int(indices.max())
    if low < 0 or high >= numel:
        raise CodecError(f"tensor {name!r}: top-k index {low if low < 0 else high} is out of range for shape "
                         f"{list(packed.shape)} ({numel} elements)")
    if k > 1:
        steps = indices[1:].long() - indices[:-1].long()
        if bool((steps == 0).any()):
            raise CodecError(f"tensor {name!r}: top-k indices hold duplicates; send each position once")
        if bool((steps < 0).any()):
            raise CodecError(f"tensor {name!r}: top-k indices are not sorted; send them strictly increasing")
    if packed.payload.is_floating_point() and not bool(torch.isfinite(packed.payload).all()):
        raise CodecError(f"tensor {name!r}: top-k values hold NaN or Inf; the sender must stop or lower its "
                         "learning rate before sending again")


# -- error feedback ----------------------------------------------------------------------
def compress_with_feedback(x: torch.Tensor, spec: CompressionSpec, dtype: torch.dtype | None,
                           residual: torch.Tensor | None) -> tuple[Packed, torch.Tensor | None]:
    """Compress ``x + residual``; returns the packed tensor and the new residual (None without feedback).

    A residual of another shape (a smaller last batch) is not added; the new
    residual is that of ``x`` alone then.
    """
    if not spec.error_feedback:
        return compress(x, spec, dtype), None
    target = x.detach().float()
    if residual is not None and residual.shape == target.shape:
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
        return held + int(getattr(self.last_reply, "wire_nbytes", 0))


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


__all__ = [
    "CompressionSpec", "ErrorFeedback", "FeedbackStore", "Packed", "WireCompression", "check_packed", "compress",
    "compress_with_feedback", "decompress", "dequantize_int8", "densify", "quantize_int8", "topk_sparsify",
]
