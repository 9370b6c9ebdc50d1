"""Tensor <-> raw bytes for the split channel: dtype, shape and bytes, never pickle.

This module knows nothing of gRPC. The channel turns :class:`EncodedTensor` into
its protobuf message and back; the codec owns the rules: which dtypes may travel,
how a shape and a byte count must agree, how large a tensor may be, and whether
NaN/Inf or empty tensors are refused.
"""

from __future__ import annotations

import enum
import math
import sys
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from splitfed.errors import CodecError, TensorValueError

MAX_NDIM = 8

# Decoded tensors view the received bytes; torch warns that such buffers are read-only.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


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


_TO_TORCH: dict[WireDType, torch.dtype] = {
    WireDType.FLOAT32: torch.float32,
    WireDType.FLOAT16: torch.float16,
    WireDType.BFLOAT16: torch.bfloat16,
    WireDType.INT64: torch.int64,
    WireDType.INT32: torch.int32,
    WireDType.BOOL: torch.bool,
    WireDType.UINT8: torch.uint8,
}
_FROM_TORCH: dict[torch.dtype, WireDType] = {v: k for k, v in _TO_TORCH.items()}
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
    try:
        return _TO_TORCH[WireDType(dtype)]
    except (ValueError, KeyError):
        raise CodecError(f"unknown or unspecified tensor dtype {int(dtype)}; send one of "
                         f"{[d.name for d in _TO_TORCH]}") from None


@dataclass(frozen=True)
class EncodedTensor:
    """A tensor as it travels: dtype, shape and raw little-endian C-order bytes."""

    name: str
    dtype: WireDType
    shape: tuple[int, ...]
    data: bytes | memoryview

    @property
    def nbytes(self) -> int:
        """Byte count the shape and dtype declare."""
        return declared_nbytes(self.dtype, self.shape)


@dataclass(frozen=True)
class TensorLimits:
    """What the decoder accepts; the server's defaults refuse NaN/Inf and empty tensors."""

    max_bytes: int = 1 << 30
    allow_empty: bool = False
    require_finite: bool = True


def declared_nbytes(dtype: WireDType | int, shape: tuple[int, ...] | list[int]) -> int:
    """Bytes a tensor of this dtype and shape occupies; raise :class:`CodecError` for bad shapes."""
    tdtype = torch_dtype(dtype)
    if len(shape) > MAX_NDIM:
        raise CodecError(f"tensor has {len(shape)} dimensions; at most {MAX_NDIM} are accepted")
    if any(int(d) < 0 for d in shape):
        raise CodecError(f"tensor shape {tuple(shape)} has a negative dimension")
    itemsize = torch.empty((), dtype=tdtype).element_size()
    return math.prod(int(d) for d in shape) * itemsize


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A read-only view of a CPU tensor's raw little-endian C-order bytes (no copy for contiguous CPU tensors).

    The view keeps the tensor's memory alive; do not modify the tensor in place
    until the bytes have been sent.
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).toreadonly()


def encode(name: str, tensor: torch.Tensor, dtype: WireDType | str | None = None) -> EncodedTensor:
    """Encode ``tensor`` under ``name``; floating tensors are cast to ``dtype`` when it is given."""
    wdt = wire_dtype(tensor.dtype) if dtype is None else wire_dtype(dtype)
    if wdt is WireDType.UNSPECIFIED:
        wdt = wire_dtype(tensor.dtype)
    if tensor.dtype.is_floating_point and wdt in FLOAT_WIRE_DTYPES:
        tensor = tensor.to(_TO_TORCH[wdt])
    elif wdt != wire_dtype(tensor.dtype):
        raise CodecError(f"tensor {name!r} of dtype {tensor.dtype} cannot travel as {wdt.name}")
    return EncodedTensor(name, wdt, tuple(tensor.shape), tensor_bytes(tensor))


_NUMPY_FLOATS = {torch.float32: np.float32, torch.float16: np.float16}
_SMALL = 1 << 20  # elements; below this a single-threaded numpy reduction beats waking torch's thread pool


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Raise :class:`TensorValueError` if a floating tensor holds NaN or Inf."""
    if not tensor.dtype.is_floating_point or tensor.numel() == 0:
        return
    # One reduction instead of an elementwise pass: any NaN/Inf makes the sum
    # non-finite; a finite tensor whose sum overflows is confirmed exactly.
    if tensor.device.type == "cpu" and tensor.dtype in _NUMPY_FLOATS and tensor.numel() < _SMALL:
        flat = tensor.detach().reshape(-1).numpy()
        total = float(np.add.reduce(flat, dtype=np.float32))
    else:
        total = float(tensor.detach().sum(dtype=torch.float32))
    if math.isfinite(total) or bool(torch.isfinite(tensor).all()):
        return
    raise TensorValueError(f"tensor {name!r} holds NaN or Inf values; the sender must stop or lower its "
                           "learning rate before sending again")


def decode(enc: EncodedTensor, limits: TensorLimits = TensorLimits()) -> torch.Tensor:
    """Decode without copying where torch allows; enforce ``limits``.

    The returned tensor may share memory with ``enc.data`` (immutable bytes):
    treat it as read-only, or clone it before writing into it.
    """
    tdtype = torch_dtype(enc.dtype)
    dtype_name = WireDType(enc.dtype).name
    nbytes = declared_nbytes(enc.dtype, enc.shape)
    if nbytes > limits.max_bytes:
        raise CodecError(f"tensor {enc.name!r} declares {nbytes} bytes, above the limit of "
                         f"{limits.max_bytes}; send smaller batches or raise the server's limit")
    if len(enc.data) != nbytes:
        raise CodecError(f"tensor {enc.name!r} declares shape {list(enc.shape)} of {dtype_name} "
                         f"({nbytes} bytes) but carries {len(enc.data)} bytes")
    if nbytes == 0:
        if not limits.allow_empty:
            raise TensorValueError(f"tensor {enc.name!r} is empty (shape {list(enc.shape)}); send at least "
                                   "one element")
        return torch.empty(enc.shape, dtype=tdtype)
    flat = torch.frombuffer(enc.data, dtype=torch.uint8)
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        flat = flat.clone()
    tensor = flat.view(tdtype).reshape(enc.shape)
    if limits.require_finite:
        check_finite(enc.name, tensor)
    return tensor
