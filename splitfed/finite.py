"""The NaN/Inf check of every tensor that arrives (:func:`check_finite`): one reduction, not an elementwise pass.

Any NaN or Inf makes a sum of squares non-finite; a finite tensor whose reduction overflows is then confirmed
exactly. Which reduction depends on the dtype and size (see the constants); pure numpy and torch.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

from splitfed.errors import TensorValueError

__all__ = ["check_finite", "is_finite"]

_NUMPY_FLOATS = {torch.float32: np.float32, torch.float16: np.float16}
_SMALL = 1 << 20  # elements; below this a single-threaded numpy reduction beats waking torch's thread pool
# elements; below this a numpy sum beats BLAS, whose first call after the thread slept (a server between calls)
# took 20 us in a trunk server for a 4 KiB tensor (2 us when warm).
_BLAS_MIN = 1 << 14


def _bf16_sum_of_squares(flat: torch.Tensor) -> float:
    """A reduction of a flat bf16 tensor that is NaN or Inf when any element is, without converting it.

    A bf16 value is the top half of an fp32 with the same exponent, so two fp32 views of the
    bits, one with the odd halves on top and one shifted by a half with the even ones on top,
    cover every element but the two ends, which are added exactly.
    """
    words = flat.view(torch.int16).numpy()
    pairs = (words.size - 1) // 2
    odd_on_top = words[: 2 * pairs].view(np.float32)
    even_on_top = words[1: 2 * pairs + 1].view(np.float32)
    ends = flat[[0, -1]].float()
    with np.errstate(over="ignore", invalid="ignore"):
        return (float(np.dot(odd_on_top, odd_on_top)) + float(np.dot(even_on_top, even_on_top))
                + float((ends * ends).sum()))


def is_finite(tensor: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN or Inf (integer tensors always do)."""
    if not tensor.dtype.is_floating_point or tensor.numel() == 0:
        return True
    # One reduction instead of an elementwise pass: any NaN/Inf makes it non-finite;
    # a finite tensor whose reduction overflows is confirmed exactly.
    if tensor.device.type == "cpu" and tensor.dtype == torch.float32 and tensor.numel() >= _BLAS_MIN:
        # BLAS dot (the sum of squares) runs several times faster than a sum; NaN and Inf propagate into it.
        flat = tensor.detach().reshape(-1).numpy()
        with np.errstate(over="ignore", invalid="ignore"):
            total = float(np.dot(flat, flat))
    elif tensor.device.type == "cpu" and tensor.dtype == torch.bfloat16 and sys.byteorder == "little":
        total = _bf16_sum_of_squares(tensor.detach().reshape(-1).contiguous())
    elif tensor.device.type == "cpu" and tensor.dtype in _NUMPY_FLOATS and tensor.numel() < _SMALL:
        flat = tensor.detach().reshape(-1).numpy()
        with np.errstate(over="ignore", invalid="ignore"):
            total = float(np.add.reduce(flat, dtype=np.float32))
    else:
        total = float(tensor.detach().sum(dtype=torch.float32))
    return math.isfinite(total) or bool(torch.isfinite(tensor).all())


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Raise :class:`TensorValueError` if a floating tensor holds NaN or Inf."""
    if not is_finite(tensor):
        raise TensorValueError(f"tensor {name!r} holds NaN or Inf values; the sender must stop or lower its "
                               "learning rate before sending again")
