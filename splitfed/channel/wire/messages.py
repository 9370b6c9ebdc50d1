"""Protobuf messages <-> codec tensors, the chunked framing of large requests and replies, and reply compression."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.wire.fastwire import ChunkView
from splitfed.codec.tensors import (
    Compressed,
    CompressionMethod,
    EncodedTensor,
    TensorLimits,
    WireDType,
    compressed_sizes,
    declared_nbytes,
    decode,
    encode,
    encode_packed,
    torch_dtype,
)
from splitfed.codec.compression import DEFAULT_BLOCK, CompressionSpec, FeedbackStore, Packed, compress
from splitfed.errors import CodecError, ResourceExhaustedError, TensorValueError
from splitfed.split.base import CUT_FIELDS, CutState

#: Names a ForwardRequest may carry, and their expected kinds.
_INT_FIELDS = frozenset({"attention_mask", "position_ids"})


def to_proto(enc: EncodedTensor, with_data: bool = True) -> pb.Tensor:
    """A ``Tensor`` message; without data (nor scales or indices) when the bytes follow as chunks."""
    msg = pb.Tensor(name=enc.name, dtype=int(enc.dtype), shape=list(enc.shape),
                    data=bytes(enc.data) if with_data else b"")
    c = enc.compressed
    if c is not None:
        msg.compressed.CopyFrom(pb.Compressed(
            method=int(c.method), dtype=int(c.dtype), block_size=c.block_size, count=c.count,
            scales=bytes(c.scales) if with_data else b"", indices=bytes(c.indices) if with_data else b""))
    return msg


def _compressed(t: pb.Tensor) -> Compressed | None:
    if not t.HasField("compressed"):
        return None
    c = t.compressed
    return Compressed(c.method, c.dtype, c.block_size, c.count, c.scales, c.indices)


def from_proto(t: pb.Tensor, data: bytes | memoryview | None = None) -> EncodedTensor:
    """An :class:`EncodedTensor` from a message (``data`` given for chunked tensors: data, then scales or indices)."""
    try:
        dtype = WireDType(t.dtype)
    except ValueError:
        raise CodecError(f"tensor {t.name!r} has unknown dtype {t.dtype}") from None
    shape = tuple(int(d) for d in t.shape)
    info = _compressed(t)
    if data is None:
        return EncodedTensor(t.name, dtype, shape, t.data, info)
    if info is None:
        return EncodedTensor(t.name, dtype, shape, data)
    enc = EncodedTensor(t.name, dtype, shape, b"", info)
    n_data, n_scales, _ = compressed_sizes(enc)
    view = memoryview(data)
    info = Compressed(info.method, info.dtype, info.block_size, info.count,
                      scales=view[n_data:n_data + n_scales], indices=view[n_data + n_scales:])
    return EncodedTensor(t.name, dtype, shape, view[:n_data], info)


def stream_nbytes(t: pb.Tensor) -> int:
    """Bytes a streamed header's tensor declares (a compressed one's data, scales and indices)."""
    if not t.HasField("compressed"):
        return declared_nbytes(t.dtype, list(t.shape))
    c = t.compressed
    if c.scales or c.indices:
        raise CodecError(f"header tensor {t.name!r} carries inline scales or indices; streamed tensors travel "
                         "as chunks")
    try:
        dtype = WireDType(t.dtype)
    except ValueError:
        raise CodecError(f"tensor {t.name!r} has unknown dtype {t.dtype}") from None
    torch_dtype(dtype)
    return sum(compressed_sizes(EncodedTensor(t.name, dtype, tuple(int(d) for d in t.shape), b"",
                                              _compressed(t))))


def payload_bytes(encs: Sequence[EncodedTensor]) -> int:
    """Total bytes of ``encs`` on the wire: raw data, or compressed data with its scales or indices."""
    return sum(e.wire_nbytes for e in encs)


def encode_state(state: CutState, dtype: WireDType | str | None,
                 compression: CompressionSpec | None = None) -> list[EncodedTensor]:
    """Encode what crosses a cut: ``hidden`` in ``dtype`` (compressed when asked), masks and positions as they are."""
    out = []
    for name, tensor in state.tensors().items():
        if name == "hidden":
            out.append(encode(name, tensor, dtype, compression))
        else:
            out.append(encode(name, tensor))
    return out


# -- reply compression ---------------------------------------------------------------
_METHOD_NAMES = {CompressionMethod.NONE: "none", CompressionMethod.INT8_BLOCKWISE: "int8",
                 CompressionMethod.TOPK: "topk"}
_METHOD_NUMBERS = {v: k for k, v in _METHOD_NAMES.items()}


def spec_to_proto(spec: CompressionSpec | None) -> pb.CompressionSpec | None:
    """The ``CompressionSpec`` message asking the server to compress a reply (None: uncompressed)."""
    if spec is None or not spec.active:
        return None
    return pb.CompressionSpec(method=int(_METHOD_NUMBERS[spec.method]), topk_ratio=spec.topk_ratio,
                              block_size=spec.block_size, error_feedback=spec.error_feedback)


def reply_spec(request: Any) -> CompressionSpec | None:
    """The reply compression a request asks for (None: none); raises :class:`CodecError` for a bad one.

    Checked before the request touches the trunk, so a bad one changes nothing.
    """
    if not request.HasField("reply_compression"):
        return None
    msg = request.reply_compression
    try:
        method = _METHOD_NAMES[CompressionMethod(msg.method)]
    except ValueError:
        raise CodecError(f"reply_compression has unknown method {msg.method}; use INT8_BLOCKWISE or TOPK") from None
    if method == "none":
        return None
    if method == "topk" and not 0.0 < msg.topk_ratio <= 1.0:
        raise CodecError(f"reply_compression.topk_ratio must be in (0, 1], got {msg.topk_ratio}")
    block = msg.block_size or DEFAULT_BLOCK
    ratio = msg.topk_ratio if method == "topk" else 1.0
    try:
        return CompressionSpec(method, ratio, block, msg.error_feedback)
    except ValueError as exc:
        raise CodecError(f"reply_compression is not valid: {exc}") from None


class ReplyCompression:
    """The trunk server's compression of its replies, with error feedback per client.

    Forward replies (activations) are compressed without feedback; backward
    replies (input gradients) carry each client's residual from its previous
    backward, kept in a bounded :class:`~splitfed.codec.compression.FeedbackStore`
    and dropped when the client leaves.
    """

    def __init__(self, store: FeedbackStore | None = None) -> None:
        self.store = store or FeedbackStore()

    def pack(self, client: str, request_id: str, name: str, tensor: torch.Tensor, dtype: WireDType | None,
             spec: CompressionSpec, feedback: bool = True) -> Packed:
        """A floating reply tensor compressed as ``spec`` asks, on the device it lies on (a trunk's GPU computes
        it there; the parts then cross at a fraction of the tensor's bytes). With ``feedback``, the client's
        residual of ``name`` is added first and the new one kept; a retried ``request_id`` gets the same parts."""
        target = torch_dtype(dtype) if dtype else tensor.dtype
        if not (feedback and spec.error_feedback):
            return compress(tensor, spec, target)
        return self.store.compress(client, request_id, name, tensor, spec, target)

    def encode(self, client: str, request_id: str, name: str, tensor: torch.Tensor, dtype: WireDType | None,
               spec: CompressionSpec | None, feedback: bool = True) -> EncodedTensor:
        """Encode a reply tensor (in host memory) as ``spec`` asks (uncompressed without one)."""
        if spec is None or not tensor.is_floating_point():
            return encode(name, tensor, dtype)
        return encode_packed(name, self.pack(client, request_id, name, tensor, dtype, spec, feedback))

    def forget(self, client: str) -> None:
        """Drop a client's residuals (it left)."""
        self.store.drop(client)


def decode_state(encs: Sequence[EncodedTensor], limits: TensorLimits,
                 ready: Mapping[str, torch.Tensor] | None = None) -> CutState:
    """Decode and check a forward's tensors: ``hidden`` (floating) plus optional int mask and positions.

    ``ready``: tensors already on the trunk's device by name (from a shared-memory region; checked for
    NaN/Inf elsewhere), checked here like the others.
    """
    seen: dict[str, torch.Tensor] = {}
    named = [(name, None, tensor) for name, tensor in (ready or {}).items()] + [(e.name, e, None) for e in encs]
    for name, enc, tensor in named:
        if name not in CUT_FIELDS:
            raise TensorValueError(f"unexpected tensor {name!r}; a forward carries {list(CUT_FIELDS)}")
        if name in seen:
            raise TensorValueError(f"tensor {name!r} appears twice")
        if tensor is None:
            assert enc is not None
            tensor = decode(enc, limits)
        if name in _INT_FIELDS and tensor.is_floating_point():
            raise TensorValueError(f"{name} must be an integer or bool tensor, got {tensor.dtype}")
        seen[name] = tensor
    _check_state(seen)
    return CutState(seen["hidden"], seen.get("attention_mask"), seen.get("position_ids"))


def _check_state(seen: Mapping[str, torch.Tensor]) -> None:
    if "hidden" not in seen:
        raise TensorValueError("forward carries no 'hidden' tensor")
    hidden = seen["hidden"]
    if not hidden.is_floating_point():
        raise TensorValueError(f"hidden must be fp32, fp16 or bf16, got {hidden.dtype}")
    mask, pos = seen.get("attention_mask"), seen.get("position_ids")
    batch = hidden.shape[0] if hidden.dim() else -1
    if mask is not None and (mask.dim() != 2 or mask.shape[0] != batch or hidden.dim() < 2
                             or mask.shape[1] < hidden.shape[1]):
        raise TensorValueError(f"attention_mask shape {list(mask.shape)} does not fit hidden {list(hidden.shape)}: "
                               "expected (batch, past + length)")
    if pos is not None and (hidden.dim() < 2 or tuple(pos.shape) not in {(batch, hidden.shape[1]),
                                                                         (1, hidden.shape[1])}):
        raise TensorValueError(f"position_ids shape {list(pos.shape)} does not fit hidden {list(hidden.shape)}: "
                               "expected (batch, length)")


def decode_single(encs: Sequence[EncodedTensor], name: str, limits: TensorLimits,
                  ready: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Decode a message that must carry exactly one tensor called ``name`` (maybe already ``ready``, see
    :func:`decode_state`)."""
    names = [*(ready or {}), *(e.name for e in encs)]
    if names != [name]:
        raise TensorValueError(f"expected exactly one tensor named {name!r}, got {names}")
    return ready[name] if ready else decode(encs[0], limits)


# -- framing ------------------------------------------------------------------
def frames(header: pb.Frame, field: str, encs: Sequence[EncodedTensor], chunk_bytes: int
           ) -> Iterator[pb.Frame | ChunkView]:
    """A header frame (tensors without data) followed by chunks of at most ``chunk_bytes``, as views."""
    msg = getattr(header, field)
    del msg.tensors[:]
    msg.tensors.extend(to_proto(e, with_data=False) for e in encs)
    yield header
    offset = 0
    for view in payload_parts(encs):
        for start in range(0, len(view), chunk_bytes):
            piece = view[start:start + chunk_bytes]
            yield ChunkView(offset, piece)
            offset += len(piece)


def payload_parts(encs: Sequence[EncodedTensor]) -> list[memoryview]:
    """The bytes a streamed message carries after its header, in order, as flat byte views: each tensor's data,
    then a compressed tensor's scales and indices (empty parts left out)."""
    out = []
    for enc in encs:
        for part in [enc.data] if enc.compressed is None else [enc.data, enc.compressed.scales,
                                                               enc.compressed.indices]:
            view = memoryview(part)
            if len(view):
                out.append(view if view.format == "B" and view.ndim == 1 else view.cast("B"))
    return out


@dataclass
class Assembled:
    """A streamed message put back together: its header and its tensors with their bytes."""

    header: Any
    tensors: list[EncodedTensor]
    #: The bulk transfer the tensors' bytes came by (a ``pb.BulkRef``), or None when they came as chunks.
    bulk: Any = None


class Gather:
    """A streamed message put back together frame by frame, as its frames arrive.

    Built from the header frame named ``field``; :meth:`feed` copies each chunk into one buffer allocated once
    the header has been checked (by ``alloc``, which returns a writable uint8 array of exactly that many bytes:
    pinned memory, say, for bytes bound for a GPU; numpy's otherwise), and :meth:`done` checks that every
    declared byte came. Raises :class:`CodecError` for a missing header, chunks out of order, too many or too
    few bytes; :class:`ResourceExhaustedError` when the header declares more than ``max_bytes``.
    """

    def __init__(self, first: pb.Frame | ChunkView | None, field: str, max_bytes: int,
                 alloc: Callable[[int], np.ndarray] | None = None) -> None:
        if not isinstance(first, pb.Frame) or first.WhichOneof("body") != field:
            got = "nothing" if first is None else "chunk" if isinstance(first, ChunkView) else first.WhichOneof(
                "body")
            raise CodecError(f"stream must start with a {field} header frame, got {got}")
        self.header = getattr(first, field)
        self.sizes = []
        for t in self.header.tensors:
            if t.data:
                raise CodecError(f"header tensor {t.name!r} carries inline data; streamed tensors travel as chunks")
            self.sizes.append(stream_nbytes(t))
        self.total = sum(self.sizes)
        if self.total > max_bytes:
            raise ResourceExhaustedError(f"streamed tensors declare {self.total} bytes, above the limit of "
                                         f"{max_bytes}")
        #: The bulk transfer that carries the bytes instead of chunks (see :meth:`adopt`).
        self.bulk = first.bulk if first.HasField("bulk") else None
        self.received = 0
        if self.bulk is not None:
            self.buf = _numpy_bytes(0)
            return
        # Not a numpy slice of it: numpy would hand a slice's views the array beneath, and ``alloc``'s array may
        # own the buffer's lifetime (a pool buffer goes back once that array is gone).
        self.buf = (alloc or _numpy_bytes)(self.total)
        if len(self.buf) != self.total:
            raise ValueError(f"alloc gave {len(self.buf)} bytes for {self.total}")

    def adopt(self, buf: np.ndarray) -> None:
        """Take ``buf`` (every byte of a bulk transfer) as the message's bytes."""
        if self.bulk is None or self.received:
            raise CodecError("only a bulk message's bytes are adopted, once")
        if len(buf) != self.total:
            raise CodecError(f"bulk transfer holds {len(buf)} bytes; the header declares {self.total}")
        self.buf, self.received = buf, self.total

    def feed(self, frame: pb.Frame | ChunkView) -> None:
        """Copy the chunk ``frame`` into its place."""
        if isinstance(frame, pb.Frame):
            if frame.WhichOneof("body") != "chunk":
                raise CodecError(f"unexpected {frame.WhichOneof('body')} frame after the header; only chunks "
                                 "may follow")
            frame = ChunkView(frame.chunk.offset, frame.chunk.data)
        if self.bulk is not None:
            raise CodecError("a message whose bytes come by a bulk link carries no chunks")
        if frame.offset != self.received:
            raise CodecError(f"chunk at offset {frame.offset} arrived out of order; expected offset "
                             f"{self.received}")
        size = len(frame.data)
        if self.received + size > self.total:
            raise CodecError(f"stream carries more than the {self.total} bytes its header declares")
        if size:
            self.buf[self.received:self.received + size] = np.frombuffer(frame.data, dtype=np.uint8)
        self.received += size

    def done(self) -> Assembled:
        """The message, once every declared byte came."""
        if self.received != self.total:
            raise CodecError(f"stream truncated: received {self.received} of {self.total} declared bytes")
        view = memoryview(self.buf)
        tensors, offset = [], 0
        for t, size in zip(self.header.tensors, self.sizes):
            tensors.append(from_proto(t, view[offset:offset + size]))
            offset += size
        return Assembled(self.header, tensors, self.bulk)


def _numpy_bytes(n: int) -> np.ndarray:
    return np.empty(n, dtype=np.uint8)


def assemble(stream: Iterable[pb.Frame | ChunkView], field: str, max_bytes: int,
             alloc: Callable[[int], np.ndarray] | None = None) -> Assembled:
    """Read a header frame named ``field`` and the chunks that follow into one buffer (see :class:`Gather`)."""
    it = iter(stream)
    gather = Gather(next(it, None), field, max_bytes, alloc)
    for frame in it:
        gather.feed(frame)
    return gather.done()
