"""Zero-copy (de)serialization of the split channel's tensor-carrying messages.

The bytes on the wire are ordinary protobuf encodings of the messages in
``split_channel.proto`` (any protobuf/gRPC peer reads and writes them). What
differs is how Python gets there: protobuf's Python runtime copies a ``bytes``
field into its arena when a message is built, again when it is serialized, and
again when the field is read after parsing. For multi-MiB activations those
copies cost more than the network. Here:

* serializing writes the message's small fields with protobuf, then appends each
  tensor as a length-delimited field straight from the tensor's memory (one
  copy, by ``bytes.join``);
* parsing walks the top-level fields, hands every non-tensor field back to
  protobuf, and returns each tensor's payload as a ``memoryview`` into the
  received buffer (no copy).

Malformed input raises :class:`~splitfed.errors.CodecError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message

from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.codec.tensors import Compressed, CompressionMethod, EncodedTensor, RegionRef, WireDType
from splitfed.errors import CodecError

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
# Field numbers from split_channel.proto.
_TENSOR_FIELD = {pb.ForwardRequest: 3, pb.ForwardReply: 2, pb.BackwardRequest: 2, pb.BackwardReply: 2}
_FRAME_CHUNK = 5
_CHUNK_OFFSET, _CHUNK_DATA = 1, 2
_T_NAME, _T_DTYPE, _T_SHAPE, _T_DATA, _T_COMPRESSED, _T_REGION = 1, 2, 3, 4, 5, 6
_C_METHOD, _C_DTYPE, _C_BLOCK, _C_COUNT, _C_SCALES, _C_INDICES = 1, 2, 3, 4, 5, 6


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint((field << 3) | wire_type)


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise CodecError("malformed message: truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _skip(buf: memoryview, pos: int, end: int, wire_type: int) -> tuple[int, int]:
    """Skip one field value; returns (start of a LEN payload or -1, position after the value)."""
    if wire_type == _VARINT:
        return -1, _read_varint(buf, pos, end)[1]
    if wire_type == _I64:
        pos += 8
    elif wire_type == _I32:
        pos += 4
    elif wire_type == _LEN:
        length, pos = _read_varint(buf, pos, end)
        start, pos = pos, pos + length
        if pos > end:
            raise CodecError("malformed message: a field runs past the end of the message")
        return start, pos
    else:
        raise CodecError(f"malformed message: unsupported wire type {wire_type}")
    if pos > end:
        raise CodecError("malformed message: a field runs past the end of the message")
    return -1, pos


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _enum(value: int, kind: type) -> Any:
    try:
        return kind(value)
    except ValueError:
        return value  # the codec refuses it with a precise message


def _parse_compressed(buf: memoryview, pos: int, end: int) -> Compressed:
    ints = {_C_METHOD: 0, _C_DTYPE: 0, _C_BLOCK: 0, _C_COUNT: 0}
    scales = indices = buf[pos:pos]
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        field, wire_type = key >> 3, key & 7
        if field in ints and wire_type == _VARINT:
            value, pos = _read_varint(buf, pos, end)
            ints[field] = _signed(value)
            continue
        start, pos = _skip(buf, pos, end, wire_type)
        if field == _C_SCALES and start >= 0:
            scales = buf[start:pos]
        elif field == _C_INDICES and start >= 0:
            indices = buf[start:pos]
    return Compressed(_enum(ints[_C_METHOD], CompressionMethod), _enum(ints[_C_DTYPE], WireDType),
                      ints[_C_BLOCK], ints[_C_COUNT], scales, indices)


def _parse_tensor(buf: memoryview, pos: int, end: int) -> EncodedTensor:
    name, dtype, shape, data = "", 0, [], buf[pos:pos]
    compressed: Compressed | None = None
    region: RegionRef | None = None
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        field, wire_type = key >> 3, key & 7
        if field == _T_SHAPE and wire_type == _LEN:  # packed
            length, pos = _read_varint(buf, pos, end)
            stop = pos + length
            if stop > end:
                raise CodecError("malformed tensor: shape runs past the end")
            while pos < stop:
                value, pos = _read_varint(buf, pos, stop)
                shape.append(_signed(value))
            continue
        if field == _T_SHAPE and wire_type == _VARINT:
            value, pos = _read_varint(buf, pos, end)
            shape.append(_signed(value))
            continue
        if field == _T_DTYPE and wire_type == _VARINT:
            dtype, pos = _read_varint(buf, pos, end)
            continue
        start, pos = _skip(buf, pos, end, wire_type)
        if field == _T_NAME and start >= 0:
            try:
                name = bytes(buf[start:pos]).decode("utf-8")
            except UnicodeDecodeError:
                raise CodecError("malformed tensor: name is not UTF-8") from None
        elif field == _T_DATA and start >= 0:
            data = buf[start:pos]
        elif field == _T_COMPRESSED and start >= 0:
            compressed = _parse_compressed(buf, start, pos)
        elif field == _T_REGION and start >= 0:
            region = region_ref(_parse_message(pb.RegionSlice, buf[start:pos]))
    return EncodedTensor(name, _enum(dtype, WireDType), tuple(shape), data, compressed, region)


def _parse_message(kind: type, data: memoryview) -> Any:
    try:
        return kind.FromString(bytes(data))
    except Exception as exc:
        raise CodecError(f"malformed {kind.__name__}: {exc}") from None


def region_ref(msg: pb.RegionSlice) -> RegionRef:
    """A :class:`RegionRef` from its message."""
    return RegionRef(msg.region, int(msg.offset), int(msg.nbytes), int(msg.event), bool(msg.device))


def region_slice(ref: RegionRef) -> pb.RegionSlice:
    """The ``RegionSlice`` message of ``ref``."""
    return pb.RegionSlice(region=ref.region, offset=ref.offset, nbytes=ref.nbytes, event=ref.event,
                          device=ref.device)


@dataclass
class Parsed:
    """A parsed message: its non-tensor fields as a protobuf message, and its tensors (zero-copy)."""

    header: Any
    tensors: list[EncodedTensor]


def _bytes_field(number: int, data: bytes | memoryview) -> list[Any]:
    """Key, length and the bytes (as a view, not copied) of a length-delimited field; nothing when empty."""
    if not len(data):
        return []
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    return [_key(number, _LEN), _varint(len(view)), view]


def _compressed_parts(info: Compressed) -> list[Any]:
    meta = pb.Compressed(method=int(info.method), dtype=int(info.dtype), block_size=info.block_size,
                         count=info.count).SerializeToString()
    inner = [meta, *_bytes_field(_C_SCALES, info.scales), *_bytes_field(_C_INDICES, info.indices)]
    return [_key(_T_COMPRESSED, _LEN), _varint(sum(len(p) for p in inner)), *inner]


def serialize(header: Message, tensors: Sequence[EncodedTensor]) -> bytes:
    """Protobuf bytes of ``header`` with ``tensors`` appended as its repeated ``tensors`` field.

    Fields go in protobuf's own order (a compressed tensor's descriptor after
    its data), so the bytes equal ``SerializeToString`` of the full message.
    """
    field = _TENSOR_FIELD[type(header)]
    parts: list[Any] = [header.SerializeToString()]
    data_key = _key(_T_DATA, _LEN)
    for enc in tensors:
        meta = pb.Tensor(name=enc.name, dtype=int(enc.dtype), shape=list(enc.shape)).SerializeToString()
        data = memoryview(enc.data).cast("B") if not isinstance(enc.data, bytes) else enc.data
        size = _varint(len(data))
        inner: list[Any] = [meta, data_key, size, data] if len(data) else [meta]
        if enc.compressed is not None:
            inner += _compressed_parts(enc.compressed)
        if enc.region is not None:
            ref = region_slice(enc.region).SerializeToString()
            inner += [_key(_T_REGION, _LEN), _varint(len(ref)), ref]
        parts += [_key(field, _LEN), _varint(sum(len(p) for p in inner)), *inner]
    return b"".join(parts)


def parse(message: type, data: bytes) -> Parsed:
    """Parse ``data`` as ``message``; tensor payloads are views into ``data``."""
    field = _TENSOR_FIELD[message]
    buf = memoryview(data)
    end = len(buf)
    pos = 0
    header_parts: list[memoryview] = []
    tensors: list[EncodedTensor] = []
    while pos < end:
        start = pos
        key, pos = _read_varint(buf, pos, end)
        number, wire_type = key >> 3, key & 7
        payload, pos = _skip(buf, pos, end, wire_type)
        if number == field and wire_type == _LEN:
            tensors.append(_parse_tensor(buf, payload, pos))
        else:
            header_parts.append(buf[start:pos])
    try:
        header = message.FromString(b"".join(header_parts))
    except Exception as exc:
        raise CodecError(f"malformed {message.__name__}: {exc}") from None
    return Parsed(header, tensors)


@dataclass
class ChunkView:
    """A chunk frame: offset and a view of its bytes."""

    offset: int
    data: memoryview | bytes


def serialize_frame(frame: pb.Frame | ChunkView) -> bytes:
    """Protobuf bytes of a ``Frame``; chunk frames are written from a view without extra copies."""
    if isinstance(frame, pb.Frame):
        return frame.SerializeToString()
    inner_head = _key(_CHUNK_OFFSET, _VARINT) + _varint(frame.offset) + _key(_CHUNK_DATA, _LEN) + \
        _varint(len(frame.data))
    return b"".join([_key(_FRAME_CHUNK, _LEN), _varint(len(inner_head) + len(frame.data)), inner_head, frame.data])


def parse_frame(data: bytes) -> pb.Frame | ChunkView:
    """Parse a ``Frame``: chunk frames as :class:`ChunkView` (zero-copy), others as protobuf messages."""
    buf = memoryview(data)
    end = len(buf)
    if end:
        key, pos = _read_varint(buf, 0, end)
        if key == (_FRAME_CHUNK << 3) | _LEN:
            length, pos = _read_varint(buf, pos, end)
            if pos + length == end:
                offset, chunk = 0, buf[pos:pos]
                while pos < end:
                    k, pos = _read_varint(buf, pos, end)
                    if k == (_CHUNK_OFFSET << 3) | _VARINT:
                        offset, pos = _read_varint(buf, pos, end)
                        continue
                    start, pos = _skip(buf, pos, end, k & 7)
                    if k >> 3 == _CHUNK_DATA and start >= 0:
                        chunk = buf[start:pos]
                return ChunkView(offset, chunk)
    try:
        return pb.Frame.FromString(data)
    except Exception as exc:
        raise CodecError(f"malformed Frame: {exc}") from None
