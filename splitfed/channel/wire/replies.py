"""What a split-channel client makes of a reply: a decoded tensor in memory of its own, a failed call as a typed
error."""

from __future__ import annotations

import dataclasses

import grpc
import numpy as np
import torch

from splitfed.channel.wire.unreachable import unavailable_hint
from splitfed.codec.tensors import EncodedTensor, TensorLimits, decode_packed
from splitfed.codec.compression import decompress
from splitfed.errors import ChannelError, TensorValueError


def channel_error(name: str, address: str, code: grpc.StatusCode, details: str | None) -> ChannelError:
    """The error of a failed call; one that found no server says how to start one, one that a running server
    refused for now (a model loading or being unloaded) says what the server said."""
    hint = unavailable_hint(address, details) if code == grpc.StatusCode.UNAVAILABLE else ""
    return ChannelError(f"{name} to trunk server {address} failed with {code.name}: {details}{hint}", code=code.name)


def computes_on_gpu(tensor: torch.Tensor) -> bool:
    """Whether the caller that sent ``tensor`` computes on a GPU (it is on one, or in pinned host memory)."""
    return tensor.is_cuda or (torch.cuda.is_available() and tensor.is_pinned())


def decoded_on(encs: list[EncodedTensor], name: str, limits: TensorLimits, device: torch.device
               ) -> torch.Tensor | None:
    """A compressed reply's one tensor (``name``) rebuilt on ``device``, a GPU: its parts are checked here and
    cross to the GPU as they came (an int8 payload is half the bytes of bf16), where the tensor is rebuilt; no
    pass over it on the host. None for a reply that is not compressed, or a device that is not a GPU."""
    if device.type != "cuda" or len(encs) != 1 or encs[0].compressed is None:
        return None
    if encs[0].name != name:
        raise TensorValueError(f"expected exactly one tensor named {name!r}, got {[encs[0].name]}")
    packed = decode_packed(encs[0], limits)
    parts = {f: getattr(packed, f).to(device) for f in ("payload", "scales", "indices")
             if getattr(packed, f) is not None}
    return decompress(dataclasses.replace(packed, **parts))


def own_reply(tensor: torch.Tensor, enc: EncodedTensor, pinned: bool) -> torch.Tensor:
    """A decoded reply (``tensor``, from ``enc``) in memory of its own.

    For a caller on a GPU, pinned host memory (its host -> device copy then runs at the copy engine's speed
    without the host waiting; from pageable memory it is several times slower and synchronous): where a streamed
    reply was gathered (:func:`pinned_bytes`), that memory itself, else a copy. Otherwise the
    tensor itself when it already owns its memory (a streamed reply's gathered, writable buffer, or a decompressed
    tensor), else a copy of the received read-only bytes.
    """
    views_received_bytes = enc.compressed is None and (isinstance(enc.data, bytes) or memoryview(enc.data).readonly)
    if pinned:
        gathered = _in_pinned_gather(tensor, enc)
        if gathered is not None:
            return gathered
        out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        out.copy_(tensor)
        return out
    return tensor.clone() if views_received_bytes else tensor


def _in_pinned_gather(tensor: torch.Tensor, enc: EncodedTensor) -> torch.Tensor | None:
    """``tensor`` as a view of the pinned tensor :func:`pinned_bytes` gathered its streamed reply in (None when it
    was not gathered there). A view of that tensor's own storage, not of its bytes: a copy to the GPU from it is then
    known to torch's caching host allocator, which reuses the memory only once that copy is done."""
    if enc.compressed is not None or not isinstance(enc.data, memoryview):
        return None
    owner = getattr(enc.data.obj, "base", None)
    if not isinstance(owner, torch.Tensor) or owner.dtype != torch.uint8 or not owner.is_pinned():
        return None
    start = tensor.data_ptr() - owner.data_ptr()
    nbytes = tensor.numel() * tensor.element_size()
    if start < 0 or start + nbytes > owner.numel() or not tensor.is_contiguous():
        return None
    try:
        return owner[start:start + nbytes].view(tensor.dtype).view(tensor.shape)
    except RuntimeError:  # an offset the dtype cannot view from: copied instead
        return None


def pinned_bytes(nbytes: int) -> np.ndarray:
    """``nbytes`` of pinned host memory (torch's caching host allocator), for a streamed reply to gather in when
    its caller computes on a GPU: :func:`own_reply` then needs no copy."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
