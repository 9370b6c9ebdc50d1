"""Copies between host tensors for the shared-memory path: one single-threaded memcpy where it can be."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["copy_into", "host_copy"]


def copy_into(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """``dst.copy_(src)``; between two host tensors of one dtype a single-threaded memcpy (torch's parallel copy
    would wake its thread pool, whose spinning threads slow the other side of the cut on a small host)."""
    if dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype and dst.is_contiguous() \
            and src.is_contiguous():
        if dst.dtype == torch.bfloat16:  # numpy has no bfloat16: copy the bits
            dst, src = dst.view(torch.int16), src.view(torch.int16)
        np.copyto(dst.numpy(), src.numpy().reshape(dst.shape))
    else:
        dst.copy_(src, non_blocking=non_blocking)


def host_copy(src: torch.Tensor, pinned: bool) -> torch.Tensor:
    """``src`` (uint8 bytes) copied into host memory of its own; pinned (for a fast copy to a GPU) when asked."""
    out = torch.empty(src.shape, dtype=torch.uint8, pin_memory=pinned)
    copy_into(out, src)
    return out
