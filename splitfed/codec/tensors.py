"""Tensor <-> raw bytes for the split channel: dtype, shape and bytes, never pickle.

This module knows nothing of gRPC. The channel turns :class:`EncodedTensor` into
its protobuf message and back; the codec owns the rules: which dtypes may travel,
how a shape and a byte count must agree, how large a tensor may be, and whether
NaN/Inf or empty tensors are refused. A compressed tensor (:class:`Compressed`,
see :mod:`splitfed.codec.compression`) travels as its compressed parts and is checked
and rebuilt here.
"""

from __future__ import annotations

import enum
import math
import sys
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from splitfed.codec.compression import MAX_BLOCK, CompressionSpec, Packed, check_packed, compress, decompress
from splitfed.errors import CodecError, TensorValueError
from splitfed.codec.finite import SMALL_BYTES, bytes_are_finite, check_finite, not_finite

MAX_NDIM = 8

# Decoded tensors view the received bytes; torch warns that such buffers are read-only.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)


class WireDType(enum.IntEnum):
    """Element types on the wire; the numbers are those of the proto's ``DType`` enum."""

    UNSPECIFIED = 0
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    INT64 = 4
    INT32 = 5
    BOOL = 6
    UINT8 = 7
    INT8 = 8


class CompressionMethod(enum.IntEnum):
    """Compression of a tensor's bytes; the numbers are those of the proto's ``CompressionMethod`` enum."""

    NONE = 0
    INT8_BLOCKWISE = 1
    TOPK = 2


_TO_TORCH: dict[WireDType, torch.dtype] = {
    WireDType.FLOAT32: torch.float32,
    WireDType.FLOAT16: torch.float16,
    WireDType.BFLOAT16: torch.bfloat16,
    WireDType.INT64: torch.int64,
    WireDType.INT32: torch.int32,
    WireDType.BOOL: torch.bool,
    WireDType.UINT8: torch.uint8,
    WireDType.INT8: torch.int8,
}
_FROM_TORCH: dict[torch.dtype, WireDType] = {v: k for k, v in _TO_TORCH.items()}
_BY_NUMBER: dict[int, torch.dtype] = {int(k): v for k, v in _TO_TORCH.items()}
_LITTLE = sys.byteorder == "little"
_BY_NAME: dict[str, WireDType] = {
    "fp32": WireDType.FLOAT32,
    "float32": WireDType.FLOAT32,
    "fp16": WireDType.FLOAT16,
    "float16": WireDType.FLOAT16,
    "bf16": WireDType.BFLOAT16,
    "bfloat16": WireDType.BFLOAT16,
}
FLOAT_WIRE_DTYPES = frozenset({WireDType.FLOAT32, WireDType.FLOAT16, WireDType.BFLOAT16})


def wire_dtype(name: str | WireDType | torch.dtype) -> WireDType:
    """Return the wire dtype for a name (``fp32``, ``fp16``, ``bf16``), a torch dtype or a WireDType."""
    if isinstance(name, WireDType):
        return name
    if isinstance(name, torch.dtype):
        if name not in _FROM_TORCH:
            raise CodecError(f"torch dtype {name} cannot travel; use one of {sorted(map(str, _FROM_TORCH))}")
        return _FROM_TORCH[name]
    try:
        return _BY_NAME[name.lower()]
    except KeyError:
        raise CodecError(f"unknown wire dtype {name!r}; use fp32, fp16 or bf16") from None


def torch_dtype(dtype: WireDType | int) -> torch.dtype:
    """Return the torch dtype of a wire dtype number; raise :class:`CodecError` for unknown ones."""
    known = _BY_NUMBER.get(dtype)
    if known is None:
        raise CodecError(f"unknown or unspecified tensor dtype {int(dtype)}; send one of "
                         f"{[d.name for d in _TO_TORCH]}")
    return known


@dataclass(frozen=True)
class Compressed:
    """How an :class:`EncodedTensor`'s data is compressed (the proto's ``Compressed`` message).

    ``dtype`` is the decoded tensor's; ``block_size`` and ``scales`` (raw fp32)
    belong to int8, ``count`` and ``indices`` (raw int32) to top-k.
    """

    method: CompressionMethod | int
    dtype: WireDType | int
    block_size: int = 0
    count: int = 0
    scales: bytes | memoryview = b""
    indices: bytes | memoryview = b""


@dataclass(frozen=True)
class RegionRef:
    """Where a tensor's bytes lie in a shared-memory region (the proto's ``RegionSlice``): client and trunk on
    one host (see :mod:`splitfed.channel.transports.shm.regions`)."""

    region: str
    offset: int
    nbytes: int
    #: 1-based index of the region's CUDA event recorded after the bytes' copy was queued (0: none).
    event: int = 0
    #: The bytes lie in the region's GPU memory (its twin on the trunk's GPU), not in its file.
    device: bool = False


@dataclass(frozen=True)
class EncodedTensor:
    """A tensor as it travels: dtype, shape and raw little-endian C-order bytes (compressed: see ``compressed``)."""

    name: str
    dtype: WireDType
    shape: tuple[int, ...]
    data: bytes | memoryview
    compressed: Compressed | None = None
    #: Set when the bytes lie in a shared-memory region instead of ``data`` (then empty).
    region: RegionRef | None = None

    @property
    def nbytes(self) -> int:
        """Byte count the shape and dtype declare."""
        return declared_nbytes(self.dtype, self.shape)

    @property
    def wire_nbytes(self) -> int:
        """Bytes this tensor puts on the wire: its data, plus scales or indices when compressed."""
        if self.compressed is None:
            return len(self.data)
        return len(self.data) + len(self.compressed.scales) + len(self.compressed.indices)


@dataclass(frozen=True)
class TensorLimits:
    """What the decoder accepts; the server's defaults refuse NaN/Inf and empty tensors."""

    max_bytes: int = 1 << 30
    allow_empty: bool = False
    require_finite: bool = True


#: Bytes per element of each wire dtype, by number.
_ITEMSIZE: dict[int, int] = {int(w): t.itemsize for w, t in _TO_TORCH.items()}


def declared_nbytes(dtype: WireDType | int, shape: tuple[int, ...] | list[int]) -> int:
    """Bytes a tensor of this dtype and shape occupies; raise :class:`CodecError` for bad shapes."""
    itemsize = _ITEMSIZE.get(dtype) if isinstance(dtype, int) else None
    if itemsize is None:
        itemsize = torch_dtype(dtype).itemsize  # raises for unknown dtypes
    if len(shape) > MAX_NDIM:
        raise CodecError(f"tensor has {len(shape)} dimensions; at most {MAX_NDIM} are accepted")
    dims = [int(d) for d in shape]
    if dims and min(dims) < 0:
        raise CodecError(f"tensor shape {tuple(shape)} has a negative dimension")
    return math.prod(dims) * itemsize


#: Torch dtypes numpy can view directly, with numpy's own (bfloat16 has none: its bytes are viewed as int16).
_NUMPY_OF: dict[torch.dtype, type] = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64,
                                      torch.int32: np.int32, torch.bool: np.bool_, torch.uint8: np.uint8,
                                      torch.int8: np.int8}
_NUMPY_DTYPES = frozenset(_NUMPY_OF)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A read-only view of a tensor's raw little-endian C-order bytes (no copy for contiguous CPU tensors; a GPU
    tensor is copied into pinned host memory).

    The view keeps the tensor's memory alive; do not modify the tensor in place
    until the bytes have been sent.
    """
    # Each torch call lets go of the interpreter lock, which the trunk's device thread may then hold a while: the
    # common case (a contiguous CPU tensor that needs no autograd detached) takes one call, a bfloat16 one two.
    if tensor.is_cpu and tensor.dim() and tensor.is_contiguous() and tensor.numel():
        plain = tensor.detach() if tensor.requires_grad else tensor
        if plain.dtype in _NUMPY_DTYPES:
            return memoryview(plain.numpy()).cast("B").toreadonly()
        if plain.dtype is torch.bfloat16:
            return memoryview(plain.view(torch.int16).numpy()).cast("B").toreadonly()
    t = tensor.detach()
    if t.is_cuda:  # into pinned memory: several times faster than into pageable memory (the copy waits either way)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t)
        t = host
    elif t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).toreadonly()


def encode(name: str, tensor: torch.Tensor, dtype: WireDType | str | None = None,
           compression: CompressionSpec | None = None) -> EncodedTensor:
    """Encode ``tensor`` under ``name``; floating tensors are cast to ``dtype`` when it is given.

    With an active ``compression``, a floating tensor travels compressed and decodes to ``dtype``
    (no error feedback here: see :func:`splitfed.codec.compression.compress_with_feedback`).
    """
    if compression is not None and compression.active and tensor.is_floating_point():
        target = _TO_TORCH[wire_dtype(dtype)] if dtype not in (None, WireDType.UNSPECIFIED) else tensor.dtype
        return encode_packed(name, compress(tensor, compression, target))
    wdt = wire_dtype(tensor.dtype) if dtype is None else wire_dtype(dtype)
    if wdt is WireDType.UNSPECIFIED:
        wdt = wire_dtype(tensor.dtype)
    if tensor.dtype.is_floating_point and wdt in FLOAT_WIRE_DTYPES:
        if tensor.dtype is not _TO_TORCH[wdt]:
            tensor = tensor.to(_TO_TORCH[wdt])
    elif wdt != wire_dtype(tensor.dtype):
        raise CodecError(f"tensor {name!r} of dtype {tensor.dtype} cannot travel as {wdt.name}")
    return EncodedTensor(name, wdt, tuple(tensor.shape), tensor_bytes(tensor))


def encode_packed(name: str, packed: Packed) -> EncodedTensor:
    """Encode a compressed tensor: int8 payloads travel as INT8, top-k values in their own dtype."""
    if packed.method == "int8":
        assert packed.scales is not None
        info = Compressed(CompressionMethod.INT8_BLOCKWISE, wire_dtype(packed.dtype), block_size=packed.block_size,
                          scales=tensor_bytes(packed.scales.float()))
        return EncodedTensor(name, WireDType.INT8, packed.shape, tensor_bytes(packed.payload), info)
    assert packed.indices is not None
    info = Compressed(CompressionMethod.TOPK, wire_dtype(packed.dtype), count=packed.indices.numel(),
                      indices=tensor_bytes(packed.indices.to(torch.int32)))
    return EncodedTensor(name, wire_dtype(packed.payload.dtype), packed.shape, tensor_bytes(packed.payload), info)


def compressed_sizes(enc: EncodedTensor) -> tuple[int, int, int]:
    """Bytes of data, scales and indices a compressed tensor's header declares; raises :class:`CodecError`."""
    info = enc.compressed
    assert info is not None
    numel = declared_nbytes(WireDType.INT8, enc.shape)  # also checks the shape
    method = _method(enc.name, info)
    if method is CompressionMethod.INT8_BLOCKWISE:
        _check_block(enc.name, info.block_size)
        return numel, 4 * math.ceil(numel / info.block_size), 0
    if not 0 <= info.count <= numel:
        raise CodecError(f"tensor {enc.name!r}: top-k keeps {info.count} of {numel} elements")
    return declared_nbytes(enc.dtype, (info.count,)), 0, 4 * info.count


def _method(name: str, info: Compressed) -> CompressionMethod:
    try:
        method = CompressionMethod(info.method)
    except ValueError:
        raise CodecError(f"tensor {name!r} has unknown compression method {int(info.method)}; use "
                         "INT8_BLOCKWISE or TOPK") from None
    if method is CompressionMethod.NONE:
        raise CodecError(f"tensor {name!r} carries a compression descriptor with method NONE; leave it unset")
    return method


def _check_block(name: str, block_size: int) -> None:
    if not 0 < block_size <= MAX_BLOCK:
        raise CodecError(f"tensor {name!r}: int8 block_size {block_size} is not in 1..{MAX_BLOCK}")


def _view(data: bytes | memoryview, dtype: torch.dtype) -> torch.Tensor:
    if len(data) == 0:
        return torch.empty(0, dtype=dtype)
    flat = torch.frombuffer(data, dtype=torch.uint8)
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        flat = flat.clone()
    return flat.view(dtype)


def decode_packed(enc: EncodedTensor, limits: TensorLimits = TensorLimits()) -> Packed:
    """A compressed tensor's parts, checked against each other and ``limits`` but not yet rebuilt: its payload,
    scales and indices view the received bytes (see :func:`~splitfed.codec.compression.decompress` to rebuild it, on
    whatever device its parts are moved to). Raises :class:`CodecError` (:class:`TensorValueError` for an empty
    tensor ``limits`` refuse)."""
    info = enc.compressed
    if info is None:
        raise CodecError(f"tensor {enc.name!r} is not compressed")
    method = _method(enc.name, info)
    out_dtype = torch_dtype(info.dtype)
    if not out_dtype.is_floating_point:
        raise CodecError(f"tensor {enc.name!r}: compressed tensors decode to FLOAT32, FLOAT16 or BFLOAT16, not "
                         f"{WireDType(info.dtype).name}")
    nbytes = declared_nbytes(info.dtype, enc.shape)
    if nbytes > limits.max_bytes:
        raise CodecError(f"tensor {enc.name!r} declares {nbytes} bytes, above the limit of "
                         f"{limits.max_bytes}; send smaller batches or raise the server's limit")
    numel = math.prod(enc.shape)
    if numel == 0 and not limits.allow_empty:
        raise TensorValueError(f"tensor {enc.name!r} is empty (shape {list(enc.shape)}); send at least one element")
    if method is CompressionMethod.INT8_BLOCKWISE:
        if enc.dtype != WireDType.INT8:
            raise CodecError(f"tensor {enc.name!r} is int8-compressed but declares dtype "
                             f"{getattr(enc.dtype, 'name', enc.dtype)}; int8 payloads travel as INT8")
        _check_block(enc.name, info.block_size)
        if len(enc.data) != numel:
            raise CodecError(f"tensor {enc.name!r}: int8 payload of shape {list(enc.shape)} ({numel} bytes) "
                             f"carries {len(enc.data)} bytes")
        blocks = math.ceil(numel / info.block_size)
        if len(info.scales) != 4 * blocks:
            raise CodecError(f"tensor {enc.name!r}: int8 payload of {numel} elements in blocks of "
                             f"{info.block_size} needs {blocks} scales, got {len(info.scales) / 4:g}")
        if info.indices:
            raise CodecError(f"tensor {enc.name!r}: int8 payload carries top-k indices")
        packed = Packed("int8", enc.shape, out_dtype, _view(enc.data, torch.int8),
                        scales=_view(info.scales, torch.float32), block_size=info.block_size)
    else:
        value_dtype = torch_dtype(enc.dtype)
        if not value_dtype.is_floating_point:
            raise CodecError(f"tensor {enc.name!r}: top-k values must be FLOAT32, FLOAT16 or BFLOAT16, not "
                             f"{WireDType(enc.dtype).name}")
        itemsize = value_dtype.itemsize
        if not 0 <= info.count <= numel:
            raise CodecError(f"tensor {enc.name!r}: top-k keeps {info.count} of {numel} elements")
        if len(enc.data) != info.count * itemsize or len(info.indices) != 4 * info.count:
            raise CodecError(f"tensor {enc.name!r}: top-k declares {info.count} values but carries "
                             f"{len(enc.data) / itemsize:g} values and {len(info.indices) / 4:g} indices")
        if info.scales:
            raise CodecError(f"tensor {enc.name!r}: top-k payload carries int8 scales")
        packed = Packed("topk", enc.shape, out_dtype, _view(enc.data, value_dtype),
                        indices=_view(info.indices, torch.int32))
    check_packed(enc.name, packed)
    return packed


def raw_nbytes(enc: EncodedTensor, limits: TensorLimits = TensorLimits()) -> int:
    """The bytes an uncompressed tensor carries, checked against its declared dtype and shape and ``limits``;
    raises :class:`CodecError`."""
    nbytes = declared_nbytes(enc.dtype, enc.shape)
    if nbytes > limits.max_bytes:
        raise CodecError(f"tensor {enc.name!r} declares {nbytes} bytes, above the limit of "
                         f"{limits.max_bytes}; send smaller batches or raise the server's limit")
    if len(enc.data) != nbytes:
        dtype_name = WireDType(enc.dtype).name
        raise CodecError(f"tensor {enc.name!r} declares shape {list(enc.shape)} of {dtype_name} "
                         f"({nbytes} bytes) but carries {len(enc.data)} bytes")
    return nbytes


def decode(enc: EncodedTensor, limits: TensorLimits = TensorLimits()) -> torch.Tensor:
    """Decode without copying where torch allows; enforce ``limits``.

    The returned tensor may share memory with ``enc.data`` (immutable bytes):
    treat it as read-only, or clone it before writing into it. A compressed
    tensor is checked part by part and rebuilt into memory of its own.
    """
    if enc.compressed is not None:
        return decompress(decode_packed(enc, limits))
    tdtype = torch_dtype(enc.dtype)
    nbytes = raw_nbytes(enc, limits)
    if nbytes == 0:
        if not limits.allow_empty:
            raise TensorValueError(f"tensor {enc.name!r} is empty (shape {list(enc.shape)}); send at least "
                                   "one element")
        return torch.empty(enc.shape, dtype=tdtype)
    if _LITTLE and nbytes < SMALL_BYTES:  # small: numpy checks the bytes in place, one torch call makes the tensor
        if limits.require_finite and tdtype.is_floating_point and not bytes_are_finite(enc.data, tdtype):
            raise not_finite(enc.name)
        np_dtype = _NUMPY_OF.get(tdtype)
        if np_dtype is not None:  # shaped by numpy: one torch call (each lets go of the interpreter lock)
            return torch.from_numpy(np.frombuffer(enc.data, dtype=np_dtype).reshape(enc.shape))
        return torch.frombuffer(enc.data, dtype=tdtype).reshape(enc.shape)
    flat = torch.frombuffer(enc.data, dtype=torch.uint8)
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        flat = flat.clone()
    tensor = flat.view(tdtype).reshape(enc.shape)
    if limits.require_finite:
        check_finite(enc.name, tensor)
    return tensor
