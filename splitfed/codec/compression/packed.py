"""A compressed tensor (:class:`Packed`): made from a tensor as a spec says, decoded, and checked on receipt."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from splitfed.codec.compression.kernels import (
    densify,
    dequantize_int8,
    quantize_int8,
    topk_sparsify,
)
from splitfed.codec.compression.spec import CompressionSpec
from splitfed.errors import CodecError, ConfigError


@dataclass(frozen=True)
class Packed:
    """A compressed tensor: what the receiver needs to rebuild it.

    ``payload`` holds one int8 per element (int8) or the kept values (top-k);
    ``scales`` one fp32 per block (int8); ``indices`` the kept flat positions,
    int32 and strictly increasing (top-k).
    """

    method: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    payload: torch.Tensor
    scales: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    block_size: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of payload, scales and indices."""
        return sum(t.numel() * t.element_size() for t in (self.payload, self.scales, self.indices) if t is not None)



# -- packing -----------------------------------------------------------------------------
def compress(x: torch.Tensor, spec: CompressionSpec, dtype: torch.dtype | None = None) -> Packed:
    """Compress ``x`` (floating) as ``spec`` says; the receiver decodes it to ``dtype`` (default ``x.dtype``)."""
    if not x.is_floating_point():
        raise ConfigError(f"only floating tensors are compressed, got {x.dtype}")
    dtype = dtype or x.dtype
    shape = tuple(x.shape)
    if spec.method == "int8":
        q, scales = quantize_int8(x, spec.block_size)
        return Packed("int8", shape, dtype, q, scales=scales, block_size=spec.block_size)
    if spec.method == "topk":
        idx, values = topk_sparsify(x, spec.topk_count(x.numel()))
        return Packed("topk", shape, dtype, values.to(dtype), indices=idx)
    raise ConfigError(f"nothing to compress with method {spec.method!r}")


def decompress(packed: Packed) -> torch.Tensor:
    """The tensor a :class:`Packed` stands for (checked inputs; see :func:`check_packed`)."""
    if packed.method == "int8":
        assert packed.scales is not None
        return dequantize_int8(packed.payload, packed.scales, packed.block_size, packed.shape, packed.dtype)
    assert packed.indices is not None
    return densify(packed.indices, packed.payload, packed.shape, packed.dtype)


def _finite_and_non_negative(scales: torch.Tensor) -> bool:
    """Whether every scale is finite and >= 0. On the host by numpy: a reduction this small costs torch a wake-up
    of its intra-op threads, which took milliseconds on a server whose cores other processes keep busy."""
    if scales.device.type != "cpu":
        return bool((scales >= 0).all() & torch.isfinite(scales).all())
    at = scales.numpy()
    return bool(at.min() >= 0 and at.max() < np.inf)  # NaN fails both comparisons


def check_packed(name: str, packed: Packed) -> None:
    """Refuse a received :class:`Packed` whose parts do not fit together; raises :class:`CodecError`.

    Checks scale and value counts, finite non-negative scales, finite values,
    and top-k positions in range and strictly increasing (no duplicates).
    """
    numel = math.prod(packed.shape)
    if packed.method == "int8":
        scales = packed.scales
        assert scales is not None
        blocks = math.ceil(numel / packed.block_size)
        if scales.numel() != blocks:
            raise CodecError(f"tensor {name!r}: int8 payload of {numel} elements in blocks of {packed.block_size} "
                             f"needs {blocks} scales, got {scales.numel()}")
        if packed.payload.numel() != numel:
            raise CodecError(f"tensor {name!r}: int8 payload holds {packed.payload.numel()} values for shape "
                             f"{list(packed.shape)} ({numel} elements)")
        if blocks and not _finite_and_non_negative(scales):
            raise CodecError(f"tensor {name!r}: int8 scales must be finite and >= 0; the sender must not "
                             "quantize NaN or Inf values")
        return
    indices = packed.indices
    assert indices is not None
    k = indices.numel()
    if packed.payload.numel() != k:
        raise CodecError(f"tensor {name!r}: top-k carries {packed.payload.numel()} values for {k} indices; send "
                         "one value per index")
    if k > numel:
        raise CodecError(f"tensor {name!r}: top-k keeps {k} of {numel} elements")
    if k == 0:
        return
    at = indices.numpy() if indices.device.type == "cpu" else indices.cpu().numpy()
    low, high = int(at.min()), int(at.max())
    if low < 0 or high >= numel:
        raise CodecError(f"tensor {name!r}: top-k index {low if low < 0 else high} is out of range for shape "
                         f"{list(packed.shape)} ({numel} elements)")
    if k > 1:
        steps = np.diff(at.astype(np.int64))
        if bool((steps == 0).any()):
            raise CodecError(f"tensor {name!r}: top-k indices hold duplicates; send each position once")
        if bool((steps < 0).any()):
            raise CodecError(f"tensor {name!r}: top-k indices are not sorted; send them strictly increasing")
    if packed.payload.is_floating_point() and not bool(torch.isfinite(packed.payload).all()):
        raise CodecError(f"tensor {name!r}: top-k values hold NaN or Inf; the sender must stop or lower its "
                         "learning rate before sending again")


__all__ = ["Packed", "check_packed", "compress", "decompress"]
