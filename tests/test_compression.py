"""Compression of what crosses the cut: error bounds, top-k, error feedback, and the wire format."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitfed.channel.wire import fastwire
from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.wire.messages import assemble, frames, payload_bytes, reply_spec, spec_to_proto, to_proto
from splitfed.codec.tensors import CompressionMethod, WireDType, decode, encode, encode_packed
from splitfed.codec.compression import (
    CompressionSpec,
    ErrorFeedback,
    FeedbackStore,
    WireCompression,
    compress,
    compress_with_feedback,
    decompress,
    dequantize_int8,
    quantize_int8,
    topk_sparsify,
)
from splitfed.config import RunConfig
from splitfed.errors import CodecError, ConfigError

INT8 = CompressionSpec("int8", block_size=64)
TOPK = CompressionSpec("topk", topk_ratio=0.05)


# -- int8 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shape, block", [((4, 64), 64), ((3, 7, 11), 16), ((1000,), 128), ((5,), 128)])
def test_int8_error_per_block_is_at_most_absmax_over_127(shape: tuple[int, ...], block: int) -> None:
    x = torch.randn(shape) * torch.logspace(-3, 2, math.prod(shape)).reshape(shape)  # blocks of very different scale
    q, scales = quantize_int8(x, block)
    back = dequantize_int8(q, scales, block, tuple(shape))
    assert q.dtype == torch.int8 and q.numel() == x.numel() and scales.numel() == math.ceil(x.numel() / block)
    flat, err = x.reshape(-1), (back - x).reshape(-1).abs()
    for b in range(scales.numel()):
        absmax = flat[b * block:(b + 1) * block].abs().max()
        assert scales[b] == absmax
        # Rounding gives absmax / 254; the bound the format promises is absmax / 127.
        assert err[b * block:(b + 1) * block].max() <= absmax / 127
        assert err[b * block:(b + 1) * block].max() <= absmax / 254 * (1 + 1e-5) + 1e-12


def test_int8_zero_blocks_and_extremes_are_exact() -> None:
    x = torch.zeros(256)
    x[200] = -3.0
    back = decompress(compress(x, INT8))
    assert torch.equal(back, x)  # a zero block has scale 0; the absmax element is exact


def test_int8_decodes_to_the_wire_dtype() -> None:
    x = torch.randn(8, 32)
    enc = encode("h", x, "bf16", INT8)
    assert enc.dtype is WireDType.INT8 and enc.compressed is not None
    assert enc.compressed.dtype == WireDType.BFLOAT16
    out = decode(enc)
    assert out.dtype == torch.bfloat16 and torch.allclose(out.float(), x, atol=0.05)


# -- top-k ------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 7, 100, 256])
def test_topk_keeps_exactly_the_k_largest(k: int) -> None:
    g = torch.Generator().manual_seed(k)
    signs = torch.randint(0, 2, (256,), generator=g).float().mul(2).sub(1)
    x = ((torch.randperm(256, generator=g).float() + 1) * signs).reshape(16, 16)  # distinct magnitudes
    idx, values = topk_sparsify(x, k)
    want = x.reshape(-1).abs().argsort(descending=True)[:k].sort().values
    assert idx.dtype == torch.int32 and torch.equal(idx.long(), want)
    assert torch.equal(values, x.reshape(-1)[want])
    dense = decompress(compress(x, CompressionSpec("topk", topk_ratio=k / 256)))
    assert int((dense != 0).sum()) == k and torch.equal(dense.reshape(-1)[want], x.reshape(-1)[want])


def test_topk_count_is_ceil_of_ratio() -> None:
    assert CompressionSpec("topk", topk_ratio=0.01).topk_count(1000) == 10
    assert CompressionSpec("topk", topk_ratio=0.01).topk_count(1001) == 11
    assert CompressionSpec("topk", topk_ratio=0.01).topk_count(5) == 1


# -- error feedback ------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [CompressionSpec("topk", topk_ratio=0.02), CompressionSpec("int8", block_size=256)],
                         ids=["topk", "int8"])
def test_error_feedback_makes_the_transmitted_sum_track_the_true_sum(spec: CompressionSpec) -> None:
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(4, 250, generator=g)  # a persistent direction, as gradients have
    ef = ErrorFeedback()
    true_sum = torch.zeros(4, 250)
    sent_sum, sent_sum_plain = torch.zeros(4, 250), torch.zeros(4, 250)
    gaps = []
    for step in range(1, 401):
        x = mean + torch.randn(4, 250, generator=g)
        packed, token = ef.compress("grad", x, spec)
        ef.commit(token)
        true_sum += x
        sent_sum += decompress(packed)
        sent_sum_plain += decompress(compress(x, spec))
        # What was not transmitted yet is exactly the residual kept for the next step.
        assert torch.allclose(true_sum - sent_sum, ef.residual("grad"), atol=1e-3)
        if step in (50, 400):
            gaps.append(float((true_sum - sent_sum).norm() / true_sum.norm()))
    # The relative gap shrinks like 1/steps: the bounded residual over a growing sum.
    assert gaps[1] < gaps[0] / 4
    plain_gap = float((true_sum - sent_sum_plain).norm() / true_sum.norm())
    if spec.method == "topk":
        assert gaps[1] < 0.1 and plain_gap > 0.5  # without feedback top-k loses most of the signal for good
    else:
        assert gaps[1] < 1e-4 < plain_gap


def test_error_feedback_skips_a_residual_of_another_shape() -> None:
    packed, residual = compress_with_feedback(torch.ones(3, 4), TOPK, None, torch.ones(5, 4))
    assert residual is not None and residual.shape == (3, 4)
    assert torch.allclose(decompress(packed) + residual, torch.ones(3, 4))


def test_feedback_store_is_bounded_and_answers_a_retry_with_the_same_reply() -> None:
    store = FeedbackStore(max_clients=2, max_bytes=1 << 20)
    x = torch.randn(10, 10)
    first = store.compress("a", "act-1", "grad", x, TOPK, torch.float32)
    again = store.compress("a", "act-1", "grad", x * 2, TOPK, torch.float32)
    assert again is first  # a retry does not apply the feedback twice
    assert store.residual("a", "grad") is not None
    store.compress("b", "act-2", "grad", x, TOPK, torch.float32)
    kept = store.compress("c", "act-3", "grad", x, TOPK, torch.float32)
    assert len(store) == 2 and store.residual("a", "grad") is None and store.evictions == 1
    store.drop("b")
    assert len(store) == 1 and store.nbytes == 10 * 10 * 4 + kept.nbytes  # the residual and the reply kept
    small = FeedbackStore(max_bytes=500)
    small.compress("a", "1", "grad", x, TOPK, torch.float32)  # 400 bytes of residual and its reply: kept
    small.compress("b", "2", "grad", x, TOPK, torch.float32)  # 800 in all: the older client goes
    assert len(small) == 1 and small.residual("b", "grad") is not None
    idle = FeedbackStore(ttl_s=0.0)
    idle.compress("a", "1", "grad", x, TOPK, torch.float32)
    idle.compress("b", "2", "grad", x, TOPK, torch.float32)
    assert idle.residual("a", "grad") is None


# -- settings -------------------------------------------------------------------------------
def test_wire_compression_names() -> None:
    assert WireCompression.of("int8").activations.method == "int8"
    assert WireCompression.of("int8").gradients.method == "int8"
    topk = WireCompression.of("topk", topk_ratio=0.1)
    assert (topk.activations.method, topk.gradients.method, topk.gradients.topk_ratio) == ("none", "topk", 0.1)
    mixed = WireCompression.of("int8", grad="topk")
    assert (mixed.activations.method, mixed.gradients.method) == ("int8", "topk")
    assert not WireCompression.of(None).gradients.active
    with pytest.raises(ConfigError, match="top-k applies to gradients"):
        WireCompression.of("none", act="topk")
    with pytest.raises(ConfigError, match="wire-compression"):
        WireCompression.of("zip")


@pytest.mark.parametrize("values, key", [({"wire-compression": "gzip"}, "wire-compression"),
                                         ({"wire-compression-act": "topk"}, "wire-compression-act"),
                                         ({"wire-compression-grad": "int4"}, "wire-compression-grad"),
                                         ({"topk-ratio": 0.0}, "topk-ratio"), ({"topk-ratio": 1.5}, "topk-ratio")])
def test_run_config_refuses_bad_compression_settings(values: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        RunConfig.from_mapping(values)


def test_run_config_reads_compression_settings() -> None:
    cfg = RunConfig.from_mapping({"wire-compression": "int8", "wire-compression-grad": "topk", "topk-ratio": 0.05,
                                  "wire-error-feedback": "false"})
    assert (cfg.wire_compression, cfg.wire_compression_grad, cfg.topk_ratio, cfg.wire_error_feedback) == \
        ("int8", "topk", 0.05, False)


# -- wire format -------------------------------------------------------------------------------
def test_uncompressed_messages_are_byte_identical_to_the_plain_format() -> None:
    # The bytes a ForwardRequest with one fp32 tensor had before compression existed.
    header = pb.ForwardRequest(activation_id="a", train=True, reply_dtype=pb.FLOAT32, num_examples=2)
    wire = fastwire.serialize(header, [encode("hidden", torch.tensor([[1.0, -2.0]]))])
    assert wire.hex() == "0a01611001200128021a180a0668696464656e10011a02010222080000803f000000c0"
    assert not pb.ForwardRequest.FromString(wire).HasField("reply_compression")


@pytest.mark.parametrize("spec, dtype", [(INT8, None), (INT8, "bf16"), (TOPK, None), (TOPK, "fp16")])
def test_compressed_tensors_round_trip_through_the_zero_copy_path(spec: CompressionSpec, dtype: str | None) -> None:
    x = torch.randn(3, 5, 40)
    enc = encode("grad", x, dtype, spec)
    header = pb.BackwardRequest(activation_id="a", reply_compression=spec_to_proto(spec))
    wire = fastwire.serialize(header, [enc])
    # Protobuf reads it; within the tensor fastwire writes protobuf's own bytes.
    msg = pb.BackwardRequest.FromString(wire)
    assert msg.tensors[0].SerializeToString() == to_proto(enc).SerializeToString()
    assert msg.tensors[0].SerializeToString() in wire
    assert msg.tensors[0].compressed.method == (pb.INT8_BLOCKWISE if spec.method == "int8" else pb.TOPK)
    parsed = fastwire.parse(pb.BackwardRequest, wire)
    got = parsed.tensors[0]
    assert got.compressed is not None and isinstance(got.data, memoryview)
    assert isinstance(got.compressed.scales if spec.method == "int8" else got.compressed.indices, memoryview)
    assert torch.equal(decode(got), decode(enc))
    assert payload_bytes([got]) == enc.wire_nbytes < x.numel() * 4 / 3.5
    asked = reply_spec(parsed.header)
    assert asked is not None and (asked.method, asked.block_size, asked.error_feedback) == \
        (spec.method, spec.block_size, spec.error_feedback)
    assert spec.method != "topk" or asked.topk_ratio == pytest.approx(spec.topk_ratio)


def test_compressed_tensors_stream_in_chunks() -> None:
    x, g = torch.randn(64, 100), torch.randn(64, 100)
    encs = [encode("hidden", x, None, INT8), encode("grad", g, None, TOPK), encode("mask", torch.ones(3))]
    stream = [fastwire.parse_frame(fastwire.serialize_frame(f))
              for f in frames(pb.Frame(forward_request=pb.ForwardRequest(activation_id="s")), "forward_request",
                              encs, chunk_bytes=333)]
    asm = assemble(iter(stream), "forward_request", 1 << 20)
    assert [decode(e).shape for e in asm.tensors] == [(64, 100), (64, 100), (3,)]
    for got, want in zip(asm.tensors, encs):
        assert torch.equal(decode(got), decode(want))
    assert payload_bytes(asm.tensors) == payload_bytes(encs)


def test_a_stream_gathers_chunk_by_chunk_into_the_buffer_alloc_gives() -> None:
    import gc
    import weakref

    import numpy as np

    from splitfed.channel.wire.messages import Gather

    x = torch.randn(8, 50)
    encs = [encode("hidden", x), encode("mask", torch.ones(8, dtype=torch.long))]
    stream = [fastwire.parse_frame(fastwire.serialize_frame(f))
              for f in frames(pb.Frame(forward_request=pb.ForwardRequest(activation_id="g")), "forward_request",
                              encs, chunk_bytes=100)]
    given: list[np.ndarray] = []
    released: list[int] = []

    def alloc(n: int) -> np.ndarray:
        # As a pool lends a buffer: an array that views a larger one, back in the pool once it is gone.
        buf = torch.full((n + 64,), 0xAB, dtype=torch.uint8).numpy()[:n]
        weakref.finalize(buf, released.append, n)
        given.append(buf)
        return buf

    gather = Gather(stream[0], "forward_request", 1 << 20, alloc)
    total = payload_bytes(encs)
    assert len(given) == 1 and len(given[0]) == total and gather.received == 0
    for i, frame in enumerate(stream[1:], 1):  # each chunk lands in place as it comes
        gather.feed(frame)
        assert gather.received == min(100 * i, total)
        assert (given[0][gather.received:] == 0xAB).all()
    asm = gather.done()
    assert torch.equal(decode(asm.tensors[0]), x) and torch.equal(decode(asm.tensors[1]), torch.ones(8).long())
    hidden = decode(asm.tensors[0])
    assert hidden.data_ptr() == given[0].ctypes.data  # a view of the given buffer: no copy after the chunks
    del given[:], gather, asm
    gc.collect()
    assert released == []  # the decoded tensor still views the buffer: it must not go back yet
    del hidden
    gc.collect()
    assert released == [total]
    with pytest.raises(ValueError, match="alloc gave"):
        Gather(stream[0], "forward_request", 1 << 20, lambda n: np.empty(n + 1, dtype=np.uint8))
    short = Gather(stream[0], "forward_request", 1 << 20)
    short.feed(stream[1])
    with pytest.raises(CodecError, match="truncated"):
        short.done()


def test_reply_spec_refuses_bad_requests() -> None:
    with pytest.raises(CodecError, match="topk_ratio"):
        reply_spec(pb.BackwardRequest(reply_compression=pb.CompressionSpec(method=pb.TOPK, topk_ratio=0.0)))
    with pytest.raises(CodecError, match="unknown method"):
        reply_spec(pb.BackwardRequest(reply_compression=pb.CompressionSpec(method=9)))
    with pytest.raises(CodecError, match="block size"):
        reply_spec(pb.BackwardRequest(reply_compression=pb.CompressionSpec(method=pb.INT8_BLOCKWISE,
                                                                           block_size=-4)))
    assert reply_spec(pb.BackwardRequest()) is None
    assert reply_spec(pb.BackwardRequest(reply_compression=pb.CompressionSpec())) is None


def test_compression_methods_match_the_proto() -> None:
    for member in CompressionMethod:
        name = "COMPRESSION_NONE" if member is CompressionMethod.NONE else member.name
        assert pb.CompressionMethod.Value(name) == int(member)


@settings(max_examples=150, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3), method=st.sampled_from(["int8", "topk"]),
       block=st.integers(1, 40), ratio=st.floats(0.01, 1.0), data=st.data())
def test_tampered_compressed_tensors_decode_consistently_or_fail_with_a_codec_error(shape, method, block, ratio,
                                                                                  data) -> None:
    x = torch.randn(shape)
    enc = encode_packed("g", compress(x, CompressionSpec(method, ratio, block)))
    msg = to_proto(enc)
    field = data.draw(st.sampled_from(["data", "scales", "indices", "block_size", "count", "dtype", "shape"]))
    blob = bytearray(data.draw(st.binary(max_size=64)))
    if field == "data":
        msg.data = bytes(blob)
    elif field in ("scales", "indices"):
        setattr(msg.compressed, field, bytes(blob))
    elif field in ("block_size", "count"):
        setattr(msg.compressed, field, data.draw(st.integers(-3, 1000)))
    elif field == "dtype":
        msg.compressed.dtype = data.draw(st.integers(0, 9))
    else:
        del msg.shape[:]
        msg.shape.extend(data.draw(st.lists(st.integers(-1, 9), max_size=3)))
    parsed = fastwire.parse(pb.BackwardRequest, pb.BackwardRequest(tensors=[msg]).SerializeToString()).tensors[0]
    try:
        out = decode(parsed)
    except CodecError:
        return
    assert out.is_floating_point() and tuple(out.shape) == tuple(parsed.shape)
