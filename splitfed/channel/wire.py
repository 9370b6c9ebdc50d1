"""Protobuf messages <-> codec tensors, and the chunked framing of large requests and replies."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from splitfed.channel import split_channel_pb2 as pb
from splitfed.channel.fastwire import ChunkView
from splitfed.codec import (
    EncodedTensor,
    TensorLimits,
    WireDType,
    decode,
    declared_nbytes,
    encode,
)
from splitfed.errors import CodecError, ResourceExhaustedError, TensorValueError
from splitfed.split.base import CUT_FIELDS, CutState

#: Names a ForwardRequest may carry, and their expected kinds.
_INT_FIELDS = frozenset({"attention_mask", "position_ids"})


def to_proto(enc: EncodedTensor, with_data: bool = True) -> pb.Tensor:
    """A ``Tensor`` message; without data when the bytes follow as chunks."""
    return pb.Tensor(name=enc.name, dtype=int(enc.dtype), shape=list(enc.shape),
                     data=bytes(enc.data) if with_data else b"")



def from_proto(t: pb.Tensor, data: bytes | memoryview | None = None) -> EncodedTensor:
    """An :class:`EncodedTensor` from a message (``data`` given for chunked tensors)."""
    try:
        dtype = WireDType(t.dtype)
    except ValueError:
        raise CodecError(f"tensor {t.name!r} has unknown dtype {t.dtype}") from None
    return EncodedTensor(t.name, dtype, tuple(int(d) for d in t.shape), t.data if data is None else data)


def payload_bytes(encs: Sequence[EncodedTensor]) -> int:
    """Total raw bytes of ``encs``."""
    return sum(len(e.data) for e in encs)


def encode_state(state: CutState, dtype: WireDType | str | None) -> list[EncodedTensor]:
    """Encode what crosses a cut: ``hidden`` in ``dtype``, masks and positions as they are."""
    out = []
    for name, tensor in state.tensors().items():
        out.append(encode(name, tensor, dtype if name == "hidden" else None))
    return out


def decode_state(encs: Sequence[EncodedTensor], limits: TensorLimits) -> CutState:
    """Decode and check a forward's tensors: ``hidden`` (floating) plus optional int mask and positions."""
    seen: dict[str, torch.Tensor] = {}
    for enc in encs:
        if enc.name not in CUT_FIELDS:
            raise TensorValueError(f"unexpected tensor {enc.name!r}; a forward carries {list(CUT_FIELDS)}")
        if enc.name in seen:
            raise TensorValueError(f"tensor {enc.name!r} appears twice")
        tensor = decode(enc, limits)
        if enc.name in _INT_FIELDS and tensor.is_floating_point():
            raise TensorValueError(f"{enc.name} must be an integer or bool tensor, got {tensor.dtype}")
        seen[enc.name] = tensor
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
    return CutState(hidden, mask, pos)


def decode_single(encs: Sequence[EncodedTensor], name: str, limits: TensorLimits) -> torch.Tensor:
    """Decode a message that must carry exactly one tensor called ``name``."""
    if len(encs) != 1 or encs[0].name != name:
        raise TensorValueError(f"expected exactly one tensor named {name!r}, got {[e.name for e in encs]}")
    return decode(encs[0], limits)


# -- framing ------------------------------------------------------------------
def frames(header: pb.Frame, field: str, encs: Sequence[EncodedTensor], chunk_bytes: int
           ) -> Iterator[pb.Frame | ChunkView]:
    """A header frame (tensors without data) followed by chunks of at most ``chunk_bytes``, as views."""
    msg = getattr(header, field)
    del msg.tensors[:]
    msg.tensors.extend(to_proto(e, with_data=False) for e in encs)
    yield header
    offset = 0
    for enc in encs:
        view = memoryview(enc.data).cast("B") if not isinstance(enc.data, bytes) else memoryview(enc.data)
        for start in range(0, len(view), chunk_bytes):
            piece = view[start:start + chunk_bytes]
            yield ChunkView(offset, piece)
            offset += len(piece)


@dataclass
class Assembled:
    """A streamed message put back together: its header and its tensors with their bytes."""

    header: Any
    tensors: list[EncodedTensor]


def assemble(stream: Iterable[pb.Frame | ChunkView], field: str, max_bytes: int) -> Assembled:
    """Read a header frame named ``field`` and the chunks that follow; check offsets and sizes.

    The tensors' bytes are gathered into one buffer allocated once the header
    has been checked. Raises :class:`CodecError` for a missing header, chunks
    out of order, too many or too few bytes; :class:`ResourceExhaustedError`
    when the header declares more than ``max_bytes``.
    """
    it = iter(stream)
    first = next(it, None)
    if not isinstance(first, pb.Frame) or first.WhichOneof("body") != field:
        got = "nothing" if first is None else "chunk" if isinstance(first, ChunkView) else first.WhichOneof("body")
        raise CodecError(f"stream must start with a {field} header frame, got {got}")
    header = getattr(first, field)
    sizes = []
    for t in header.tensors:
        if t.data:
            raise CodecError(f"header tensor {t.name!r} carries inline data; streamed tensors travel as chunks")
        sizes.append(declared_nbytes(t.dtype, list(t.shape)))
    total = sum(sizes)
    if total > max_bytes:
        raise ResourceExhaustedError(f"streamed tensors declare {total} bytes, above the limit of {max_bytes}")
    buf = np.empty(total, dtype=np.uint8)
    received = 0
    for frame in it:
        if isinstance(frame, pb.Frame):
            if frame.WhichOneof("body") != "chunk":
                raise CodecError(f"unexpected {frame.WhichOneof('body')} frame after the header; only chunks "
                                 "may follow")
            frame = ChunkView(frame.chunk.offset, frame.chunk.data)
        if frame.offset != received:
            raise CodecError(f"chunk at offset {frame.offset} arrived out of order; expected offset {received}")
        size = len(frame.data)
        if received + size > total:
            raise CodecError(f"stream carries more than the {total} bytes its header declares")
        if size:
            buf[received:received + size] = np.frombuffer(frame.data, dtype=np.uint8)
        received += size
    if received != total:
        raise CodecError(f"stream truncated: received {received} of {total} declared bytes")
    view = memoryview(buf)
    tensors, offset = [], 0
    for t, size in zip(header.tensors, sizes):
        tensors.append(from_proto(t, view[offset:offset + size]))
        offset += size
    return Assembled(header, tensors)
