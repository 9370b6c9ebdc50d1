"""The codec: exact round trips, precise refusals, and fuzzing of hostile inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.codec.tensors import EncodedTensor, TensorLimits, WireDType, check_finite, decode, encode, wire_dtype
from splitfed.errors import CodecError, TensorValueError


def test_wire_dtype_numbers_match_the_proto() -> None:
    for member in WireDType:
        name = "DTYPE_UNSPECIFIED" if member is WireDType.UNSPECIFIED else member.name
        assert pb.DType.Value(name) == int(member)
    assert set(pb.DType.keys()) == {"DTYPE_UNSPECIFIED"} | {m.name for m in WireDType if m.value}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                                   torch.bool, torch.uint8])
def test_round_trip_is_exact(dtype: torch.dtype) -> None:
    t = (torch.randn(3, 4, 5) * 10).to(dtype)
    enc = encode("x", t)
    assert enc.nbytes == len(enc.data) == t.numel() * t.element_size()
    back = decode(enc)
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


def test_decode_is_zero_copy() -> None:
    enc = encode("x", torch.randn(64, 64))
    back = decode(enc)
    assert back.untyped_storage().data_ptr() == torch.frombuffer(enc.data, dtype=torch.uint8).data_ptr()


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_floats_travel_in_the_wire_dtype(name: str) -> None:
    t = torch.randn(8, 16)
    enc = encode("h", t, name)
    assert enc.dtype == wire_dtype(name) and len(enc.data) == t.numel() * 2
    assert torch.allclose(decode(enc).float(), t, atol=1e-2, rtol=1e-2)


def test_non_contiguous_and_scalar_tensors() -> None:
    t = torch.randn(4, 6).t()
    assert torch.equal(decode(encode("t", t)), t)
    s = torch.tensor(3.5)
    assert torch.equal(decode(encode("s", s)), s)


@pytest.mark.parametrize(
    "enc, error, match",
    [
        (EncodedTensor("x", WireDType.UNSPECIFIED, (2,), b"\0" * 8), CodecError, "dtype"),
        (EncodedTensor("x", 99, (2,), b"\0" * 8), CodecError, "dtype"),  # type: ignore[arg-type]
        (EncodedTensor("x", WireDType.FLOAT32, (2, 3), b"\0" * 20), CodecError, "carries 20 bytes"),
        (EncodedTensor("x", WireDType.FLOAT32, (2, -3), b""), CodecError, "negative"),
        (EncodedTensor("x", WireDType.FLOAT32, (1,) * 9, b"\0" * 4), CodecError, "dimensions"),
        (EncodedTensor("x", WireDType.FLOAT32, (1 << 40, 1 << 20), b"\0" * 4), CodecError, "above the limit"),
        (EncodedTensor("x", WireDType.FLOAT32, (0, 4), b""), TensorValueError, "empty"),
        (encode("x", torch.tensor([1.0, float("nan")])), TensorValueError, "NaN"),
        (encode("x", torch.tensor([float("inf"), 1.0])), TensorValueError, "NaN or Inf"),
        (encode("x", torch.tensor([float("-inf")], dtype=torch.bfloat16)), TensorValueError, "NaN or Inf"),
    ],
)
def test_bad_tensors_are_refused(enc: EncodedTensor, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        decode(enc)


def test_large_finite_values_whose_sum_overflows_are_accepted() -> None:
    t = torch.full((4,), 3e38)
    assert torch.equal(decode(encode("big", t)), t)


def test_limits_can_allow_empty_and_non_finite() -> None:
    limits = TensorLimits(allow_empty=True, require_finite=False)
    assert decode(EncodedTensor("e", WireDType.FLOAT32, (0, 3), b""), limits).shape == (0, 3)
    assert torch.isnan(decode(encode("n", torch.tensor([float("nan")])), limits)).all()


@settings(max_examples=300, deadline=None)
@given(dtype=st.integers(-5, 12), shape=st.lists(st.integers(-3, 1 << 20), max_size=10),
       data=st.binary(max_size=256))
def test_fuzzed_tensors_decode_or_fail_cleanly(dtype: int, shape: list[int], data: bytes) -> None:
    """Any (dtype, shape, bytes) either decodes consistently or raises a CodecError, never anything else."""
    limits = TensorLimits(max_bytes=1 << 16)
    try:
        enc = EncodedTensor("f", dtype, tuple(shape), data)  # type: ignore[arg-type]
        t = decode(enc, limits)
    except CodecError:
        return
    assert t.numel() * t.element_size() == len(data)
    assert list(t.shape) == shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 2, 3, 8, 9])
def test_a_non_finite_value_is_found_at_every_position(dtype: torch.dtype, n: int) -> None:
    """The fast reductions (BLAS dot; bf16 read as fp32 halves) miss no element, odd lengths and ends included."""
    torch.manual_seed(n)
    check_finite("ok", torch.randn(n).to(dtype))
    check_finite("strided", torch.randn(n, 4).to(dtype)[:, ::2])
    for pos in range(n):
        for bad in (float("nan"), float("inf"), -float("inf")):
            x = torch.randn(n).to(dtype)
            x[pos] = bad
            with pytest.raises(TensorValueError, match="NaN or Inf"):
                check_finite("x", x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_finite_check_agrees_with_torch_on_every_16_bit_pattern(dtype: torch.dtype) -> None:
    """All 65,536 bit patterns of a 16-bit float, alone and in one tensor: NaN and Inf of either sign (every NaN
    payload), the largest finite values, subnormals and -0.0 are judged as torch.isfinite judges them."""
    from splitfed.codec.finite import is_finite

    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = torch.isfinite(every)
    assert not is_finite(every)
    assert is_finite(every[finite])
    verdicts = [is_finite(every[i:i + 1]) for i in range(every.numel())]
    assert verdicts == finite.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_finite_check_finds_values_past_its_first_block_and_accepts_extremes(dtype: torch.dtype) -> None:
    """Tensors longer than one block of the check (and than the fp32 BLAS threshold), with the bad value in the
    last block, at a block's edge, and the extremes of the dtype (whose sum of squares overflows) accepted."""
    from splitfed.codec import finite

    n = 3 * finite._BLOCK + 5
    info = torch.finfo(dtype)
    extremes = torch.full((n,), info.max, dtype=dtype)
    extremes[1::2] = info.min
    extremes[::7] = info.tiny / 2 if dtype != torch.bfloat16 else -0.0
    assert finite.is_finite(extremes)
    for pos in (0, finite._BLOCK - 1, finite._BLOCK, 2 * finite._BLOCK + 1, n - 1):
        for bad in (float("nan"), -float("nan"), float("inf"), -float("inf")):
            x = torch.zeros(n, dtype=dtype)
            x[pos] = bad
            assert not finite.is_finite(x), (pos, bad)


@pytest.mark.parametrize("offset", [0, 1, 2, 3])
@pytest.mark.parametrize("large", [False, True])
def test_the_finite_check_reads_tensors_at_any_offset_of_a_message(offset: int, large: bool) -> None:
    """A tensor's bytes lie wherever its field falls in the received message, often not at a multiple of 4: the
    check finds NaN and Inf there too, below and past the BLAS threshold."""
    from splitfed.codec import finite

    n = finite._BLAS_MIN + 3 if large else 1021
    good = torch.randn(n)
    for bad in (None, float("nan"), -float("inf")):
        x = good.clone()
        if bad is not None:
            x[n // 2] = bad
        message = bytes(offset) + x.numpy().tobytes()
        enc = EncodedTensor("x", WireDType.FLOAT32, (n,), memoryview(message)[offset:])
        if bad is None:
            assert torch.equal(decode(enc), x)
        else:
            with pytest.raises(TensorValueError, match="NaN or Inf"):
                decode(enc)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_in_place_check_of_small_buffers_agrees_with_torch_on_every_16_bit_pattern(dtype: torch.dtype) -> None:
    """Small received buffers are checked as bytes, before any tensor is made (:func:`bytes_are_finite`): every
    16-bit pattern alone, then all of them in one buffer, judged as torch.isfinite judges them."""
    from splitfed.codec.finite import bytes_are_finite

    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    data = every.numpy().tobytes()
    finite = torch.isfinite(every.view(dtype))
    assert [bytes_are_finite(data[2 * i:2 * i + 2], dtype) for i in range(every.numel())] == finite.tolist()
    assert not bytes_are_finite(data, dtype)
    assert bytes_are_finite(every[finite].numpy().tobytes(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_small_tensors_decode_exactly_and_refuse_a_non_finite_value_anywhere(dtype: torch.dtype) -> None:
    """Below SMALL_BYTES a tensor's bytes are checked in place and viewed by one torch call: the same values, the
    dtype's extremes accepted, and a NaN or Inf at any position (any byte offset of the message) refused."""
    from splitfed.codec.finite import SMALL_BYTES

    info = torch.finfo(dtype)
    x = torch.randn(6, 7).to(dtype)
    x[0, 0], x[0, 1], x[0, 2] = info.max, info.min, -0.0
    assert x.numel() * x.element_size() < SMALL_BYTES
    for offset in (0, 1, 3):
        message = bytes(offset) + x.view(torch.int8 if dtype == torch.float32 else torch.int16).numpy().tobytes()
        enc = EncodedTensor("x", wire_dtype(dtype), tuple(x.shape), memoryview(message)[offset:])
        assert torch.equal(decode(enc), x) and decode(enc).dtype == dtype
    for pos in range(x.numel()):
        for bad in (float("nan"), float("inf"), -float("inf")):
            y = x.clone().reshape(-1)
            y[pos] = bad
            with pytest.raises(TensorValueError, match="NaN or Inf"):
                decode(encode("x", y.reshape(x.shape)))
