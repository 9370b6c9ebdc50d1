"""The NaN/Inf check of every tensor that arrives (:func:`check_finite`): reductions, never an elementwise pass.

A float is NaN or Inf exactly when its exponent bits are all ones. Read as integers of the same width, a positive
one is then at least the exponent mask (a signed maximum finds it) and a negative one at least the sign bit with
the mask (an unsigned maximum finds it): two integer maxima over the tensor's own bits, exact, with no temporary
array and no float arithmetic. They run block by block, so that the second reads what the first brought into the
cache. Large aligned fp32 tensors take one BLAS dot product (the sum of squares, which any NaN or Inf makes
non-finite) instead, a single pass; a finite tensor whose sum overflows is then confirmed by the exact check.
Pure numpy and torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from splitfed.errors import TensorValueError

__all__ = ["SMALL_BYTES", "FiniteFlag", "bytes_are_finite", "check_finite", "is_finite", "not_finite"]

#: Per float dtype: the integer dtype of its width, the smallest positive non-finite bit pattern (the exponent
#: mask) and the smallest negative one (sign bit and exponent mask, unsigned).
_BITS: dict[torch.dtype, tuple[torch.dtype, type, int, int]] = {
    torch.float32: (torch.int32, np.uint32, 0x7F800000, 0xFF800000),
    torch.bfloat16: (torch.int16, np.uint16, 0x7F80, 0xFF80),
    torch.float16: (torch.int16, np.uint16, 0x7C00, 0xFC00),
}
#: Elements per block of the exact check (a few hundred KiB: the block stays in the cache between the two maxima).
_BLOCK = 1 << 17
#: floating dtypes numpy holds (bfloat16 is not one), with numpy's
_NUMPY_OF: dict[torch.dtype, type] = {torch.float32: np.float32, torch.float16: np.float16}
#: fp32 elements from which a BLAS dot beats the two maxima (one pass instead of two); below, waking BLAS after the
#: thread slept costs more (20 us in a trunk server for a 4 KiB tensor, 2 us when warm).
_BLAS_MIN = 1 << 14
#: Received buffers below this many bytes are checked by :func:`bytes_are_finite`, in place: at this size a torch
#: call (several to make a tensor and flatten it) costs more than numpy's whole pass.
SMALL_BYTES = 1 << 16
_SIGNED_OF: dict[torch.dtype, type] = {torch.int32: np.int32, torch.int16: np.int16}


def _exact(flat: torch.Tensor) -> bool:
    """Whether a flat contiguous CPU float tensor of a dtype in :data:`_BITS` holds no NaN or Inf (exact)."""
    int_dtype, unsigned, positive, negative = _BITS[flat.dtype]
    signed_bits = flat.view(int_dtype).numpy()
    unsigned_bits = signed_bits.view(unsigned)
    for start in range(0, signed_bits.size, _BLOCK):
        if signed_bits[start:start + _BLOCK].max() >= positive or \
                unsigned_bits[start:start + _BLOCK].max() >= negative:
            return False
    return True


def is_finite(tensor: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN or Inf (integer tensors always do)."""
    if not tensor.dtype.is_floating_point or tensor.numel() == 0:
        return True
    if tensor.device.type != "cpu" or tensor.dtype not in _BITS:
        # One reduction instead of an elementwise pass; a finite tensor whose sum overflows is confirmed exactly.
        return math.isfinite(float(tensor.detach().sum(dtype=torch.float32))) or bool(torch.isfinite(tensor).all())
    flat = tensor.detach().reshape(-1)  # contiguous: reshape copies a tensor it cannot view flat
    if flat.numel() < _BLAS_MIN and flat.dtype in _NUMPY_OF:  # small: numpy's one pass, exact (2 us at 4 KiB)
        return bool(np.isfinite(flat.numpy()).all())
    if flat.dtype == torch.float32 and flat.numel() >= _BLAS_MIN and flat.data_ptr() % 4 == 0:
        # (BLAS takes aligned data only: numpy's own loop over unaligned floats, e.g. a tensor at an odd offset of
        # a received message, runs 5x slower than the two maxima.)
        values = flat.numpy()
        with np.errstate(over="ignore", invalid="ignore"):
            if math.isfinite(float(np.dot(values, values))):
                return True
    return _exact(flat)


def bytes_are_finite(data: bytes | memoryview, dtype: torch.dtype) -> bool:
    """Whether a non-empty little-endian buffer of ``dtype`` floats (fp32, fp16 or bf16) holds no NaN or Inf, read
    in place by numpy (exact; no tensor is made). Meant for buffers below :data:`SMALL_BYTES`."""
    if dtype in _NUMPY_OF:
        return bool(np.isfinite(np.frombuffer(data, dtype=_NUMPY_OF[dtype])).all())
    int_dtype, unsigned, positive, negative = _BITS[dtype]
    signed_bits = np.frombuffer(data, dtype=_SIGNED_OF[int_dtype])
    return not (signed_bits.max() >= positive or signed_bits.view(unsigned).max() >= negative)


def not_finite(name: str) -> TensorValueError:
    """The error for a tensor ``name`` that holds NaN or Inf."""
    return TensorValueError(f"tensor {name!r} holds NaN or Inf values; the sender must stop or lower its "
                            "learning rate before sending again")


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Raise :class:`TensorValueError` if a floating tensor holds NaN or Inf."""
    if not is_finite(tensor):
        raise not_finite(name)


@dataclass(frozen=True)
class FiniteFlag:
    """Whether a device tensor holds no NaN or Inf, computed on the device and read later without a stall.

    :meth:`of` queues the check and a copy of its one-byte answer into pinned host memory on the current stream,
    with an event after the copy. :meth:`read` waits for that event only: for the check, never for the work
    queued on the stream after it (reading the device tensor itself would wait for all of it, leaving the GPU
    idle until the host queues more).
    """

    value: torch.Tensor
    #: Recorded after the copy to the host (None: ``value`` is on the CPU already).
    done: torch.cuda.Event | None = None

    @classmethod
    def of(cls, tensor: torch.Tensor) -> FiniteFlag:
        """Queue the check of ``tensor`` (after the work already queued on the current stream)."""
        ok = torch.isfinite(tensor).all()
        if not ok.is_cuda:
            return cls(ok)
        host = torch.empty((), dtype=torch.bool, pin_memory=True)
        host.copy_(ok, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return cls(host, done)

    def read(self) -> bool:
        """The answer (waits for the check and its copy, nothing queued after them)."""
        if self.done is not None:
            self.done.synchronize()
        return bool(self.value)
