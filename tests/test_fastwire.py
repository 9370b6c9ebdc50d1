"""The zero-copy wire path writes and reads exactly what protobuf does; hostile bytes fail cleanly (fuzzed)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitfed.channel.wire import fastwire
from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.codec.tensors import EncodedTensor, WireDType, encode
from splitfed.errors import CodecError

names = st.sampled_from(["hidden", "attention_mask", "position_ids", "grad", "x", "é"])
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4)


@st.composite
def tensors(draw) -> EncodedTensor:
    shape = tuple(draw(shapes))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool]))
    t = (torch.randn(shape) * 3).to(dtype)
    return encode(draw(names), t)


@settings(max_examples=150, deadline=None)
@given(act=st.text(max_size=20), train=st.booleans(), n=st.integers(0, 2**40), session=st.text(max_size=8),
       items=st.lists(tensors(), max_size=4))
def test_serialize_is_read_by_protobuf_and_parse_reads_protobuf(act, train, n, session, items) -> None:
    header = pb.ForwardRequest(activation_id=act, train=train, num_examples=n, session_id=session,
                               reply_dtype=pb.BFLOAT16)
    wire = fastwire.serialize(header, items)
    # protobuf reads what fastwire wrote...
    msg = pb.ForwardRequest.FromString(wire)
    assert (msg.activation_id, msg.train, msg.num_examples, msg.session_id) == (act, train, n, session)
    assert [(t.name, t.dtype, tuple(t.shape), t.data) for t in msg.tensors] == \
        [(e.name, int(e.dtype), e.shape, bytes(e.data)) for e in items]
    # ...and fastwire reads what protobuf wrote (fields in protobuf's own order), zero-copy.
    full = pb.ForwardRequest(activation_id=act, train=train, num_examples=n, session_id=session,
                             reply_dtype=pb.BFLOAT16, tensors=[pb.Tensor(name=e.name, dtype=int(e.dtype),
                                                                         shape=list(e.shape), data=bytes(e.data))
                                                               for e in items])
    parsed = fastwire.parse(pb.ForwardRequest, full.SerializeToString())
    assert parsed.header.activation_id == act and parsed.header.num_examples == n
    assert [(t.name, t.dtype, t.shape, bytes(t.data)) for t in parsed.tensors] == \
        [(e.name, e.dtype, e.shape, bytes(e.data)) for e in items]


@settings(max_examples=400, deadline=None)
@given(data=st.binary(max_size=300))
def test_hostile_bytes_parse_or_fail_with_a_codec_error(data: bytes) -> None:
    for message in (pb.ForwardRequest, pb.BackwardRequest, pb.ForwardReply, pb.BackwardReply):
        try:
            parsed = fastwire.parse(message, data)
        except CodecError:
            continue
        assert isinstance(parsed.header, message)
    try:
        frame = fastwire.parse_frame(data)
    except CodecError:
        return
    assert isinstance(frame, (pb.Frame, fastwire.ChunkView))


@settings(max_examples=100, deadline=None)
@given(offset=st.integers(0, 2**50), data=st.binary(max_size=200))
def test_chunk_frames_round_trip(offset: int, data: bytes) -> None:
    wire = fastwire.serialize_frame(fastwire.ChunkView(offset, memoryview(data)))
    assert pb.Frame.FromString(wire).chunk == pb.Chunk(offset=offset, data=data)
    parsed = fastwire.parse_frame(wire)
    assert isinstance(parsed, fastwire.ChunkView) and parsed.offset == offset and bytes(parsed.data) == data


def test_negative_shapes_survive_the_wire_for_the_codec_to_refuse() -> None:
    wire = pb.ForwardRequest(tensors=[pb.Tensor(name="h", dtype=1, shape=[-2, 3])]).SerializeToString()
    parsed = fastwire.parse(pb.ForwardRequest, wire)
    assert parsed.tensors[0].shape == (-2, 3)
    assert parsed.tensors[0].dtype is WireDType.FLOAT32


@pytest.mark.parametrize("data", [b"\x1a\x05abc", b"\x1a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
                                  b"\x0f", b"\x1a\x03\x22\x10x"])
def test_truncated_and_overlong_fields_are_codec_errors(data: bytes) -> None:
    with pytest.raises(CodecError):
        fastwire.parse(pb.ForwardRequest, data)


@st.composite
def compressed_tensors(draw) -> EncodedTensor:
    from splitfed.codec.tensors import encode_packed
    from splitfed.codec.compression import CompressionSpec, compress

    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    spec = CompressionSpec(draw(st.sampled_from(["int8", "topk"])), draw(st.floats(0.05, 1.0)),
                           draw(st.integers(1, 50)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    return encode_packed(draw(names), compress(torch.randn(shape), spec, dtype))


@settings(max_examples=100, deadline=None)
@given(items=st.lists(st.one_of(tensors(), compressed_tensors()), max_size=4))
def test_compressed_tensors_are_read_by_protobuf_and_parsed_zero_copy(items) -> None:
    header = pb.BackwardRequest(activation_id="a", reply_compression=pb.CompressionSpec(method=pb.TOPK,
                                                                                         topk_ratio=0.5))
    wire = fastwire.serialize(header, items)
    msg = pb.BackwardRequest.FromString(wire)
    assert msg.reply_compression.method == pb.TOPK

    def fields(e: EncodedTensor) -> tuple:
        c = e.compressed
        return (e.name, int(e.dtype), tuple(e.shape), bytes(e.data)) + (
            () if c is None else (int(c.method), int(c.dtype), c.block_size, c.count, bytes(c.scales),
                                  bytes(c.indices)))

    def proto_fields(t: pb.Tensor) -> tuple:
        c = t.compressed
        return (t.name, t.dtype, tuple(t.shape), t.data) + (
            () if not t.HasField("compressed") else (c.method, c.dtype, c.block_size, c.count, c.scales, c.indices))

    assert [proto_fields(t) for t in msg.tensors] == [fields(e) for e in items]
    # fastwire reads what protobuf wrote, with the payloads as views of the received bytes.
    parsed = fastwire.parse(pb.BackwardRequest, msg.SerializeToString())
    assert [fields(e) for e in parsed.tensors] == [fields(e) for e in items]
    assert all(isinstance(e.compressed.scales, memoryview) and isinstance(e.compressed.indices, memoryview)
               for e in parsed.tensors if e.compressed is not None)
