"""The compressors' arithmetic: blockwise absmax int8 and top-k sparsification, each with its inverse."""

from __future__ import annotations

import math

import torch

from splitfed.codec.compression.spec import DEFAULT_BLOCK
from splitfed.errors import ConfigError

#: Top-k positions travel as int32.
MAX_TOPK_ELEMENTS = (1 << 31) - 1


# -- int8 ------------------------------------------------------------------------------
def quantize_int8(x: torch.Tensor, block_size: int = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax int8 of ``x`` flattened: ``(q, scales)``, q int8 per element, one fp32 scale per block."""
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    blocks = math.ceil(n / block_size)
    if blocks * block_size != n:
        flat = torch.nn.functional.pad(flat, (0, blocks * block_size - n))
    view = flat.view(blocks, block_size)
    scales = view.abs().amax(dim=1)
    # Tensor by tensor, correctly rounded on every device: a division by a Python number may run as a
    # multiplication by its reciprocal on a GPU, and the parts would differ from the host's.
    inv = torch.where(scales > 0, torch.full_like(scales, 127.0) / scales, torch.zeros_like(scales))
    q = (view * inv[:, None]).round_().clamp_(-127, 127).to(torch.int8).reshape(-1)
    return (q[:n] if q.numel() != n else q), scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, block_size: int, shape: tuple[int, ...],
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale / 127`` per block, shaped ``shape`` in ``dtype`` (inputs as :func:`quantize_int8` gives)."""
    n = q.numel()
    full = n // block_size
    out = torch.empty(n, dtype=torch.float32, device=q.device)
    step = scales.float() / torch.full_like(scales, 127.0, dtype=torch.float32)  # as in quantize_int8
    if full:
        torch.mul(q[:full * block_size].view(full, block_size), step[:full, None],
                  out=out[:full * block_size].view(full, block_size))
    if full * block_size != n:
        torch.mul(q[full * block_size:], step[full], out=out[full * block_size:])
    return out.view(shape).to(dtype)


# -- top-k -----------------------------------------------------------------------------
def topk_sparsify(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` elements of ``x`` of largest magnitude: ``(indices, values)``, int32 flat positions ascending."""
    flat = x.detach().reshape(-1)
    if flat.numel() > MAX_TOPK_ELEMENTS:
        raise ConfigError(f"top-k handles tensors of at most {MAX_TOPK_ELEMENTS} elements; use int8 instead")
    idx = flat.abs().float().topk(k, sorted=False).indices.sort().values
    return idx.to(torch.int32), flat[idx]


def densify(indices: torch.Tensor, values: torch.Tensor, shape: tuple[int, ...],
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Zeros of ``shape`` with ``values`` at the flat ``indices``."""
    out = torch.zeros(math.prod(shape), dtype=dtype, device=values.device)
    out[indices.long()] = values.to(dtype)
    return out.view(shape)


__all__ = ["MAX_TOPK_ELEMENTS", "densify", "dequantize_int8", "quantize_int8", "topk_sparsify"]
