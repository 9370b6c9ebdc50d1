"""A shared-memory call's copies: its tensors into the region's slices, its reply out of one, and the slices given
back once it succeeded."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import torch

from splitfed.channel.transports.shm.regions import copy_into
from splitfed.channel.transports.shm.slices import ClientRegion, Slice
from splitfed.codec.tensors import EncodedTensor, WireDType, torch_dtype
from splitfed.errors import ChannelError, CodecError, TensorValueError


def write_slices(region: ClientRegion, sends: list[tuple[str, torch.Tensor, WireDType]], slices: list[Slice],
                 events: tuple[int, int] | None) -> tuple[list[EncodedTensor], Any]:
    """Copy each tensor into its slice (on the device's stream, the request event recorded after, when
    events order the copies); returns their messages and the reply slice's reference."""
    encs = []
    for (tname, t, wdt), piece in zip(sends, slices):
        dtype = torch_dtype(wdt)
        if t.is_cuda:
            if not piece.device:
                region.pin()
            if t.dtype != dtype:
                t = t.to(dtype)  # cast on the device: fewer bytes to copy
        copy_into(piece.tensor(dtype, tuple(t.shape), device=piece.device), t,
                  non_blocking=events is not None and t.is_cuda)
        ref = piece.ref if events is None or not t.is_cuda else replace(piece.ref, event=events[0])
        encs.append(EncodedTensor(tname, wdt, tuple(t.shape), b"", None, ref))
    reply = slices[-1].ref
    if events is not None:  # the server's stream waits for these copies; this host does not
        assert region.events is not None
        region.events[events[0]].record(torch.cuda.current_stream(sends[0][1].device))
        reply = replace(reply, event=events[1])
    return encs, reply


def give_slices(region: ClientRegion, slices: list[Slice], events: tuple[int, int] | None) -> None:
    """Give a call's slices and CUDA events back to the region (only once the call succeeded: see
    :meth:`ClientRegion.poison`)."""
    for piece in slices:
        region.give(piece)
    if events is not None:
        region.give_events(events)


def needed_bytes(exc: ChannelError) -> int | None:
    """The reply size a RESOURCE_EXHAUSTED "use ForwardStream" error names (None for any other error)."""
    if exc.code != "RESOURCE_EXHAUSTED":
        return None
    found = re.search(r"reply of (\d+) bytes is above the unary threshold", str(exc))
    return int(found.group(1)) if found else None


def read_reply(call: str, encs: list[EncodedTensor], region: ClientRegion, dst: Slice, device: torch.device | None,
               on_device: bool, limits: Any) -> tuple[torch.Tensor, int, bool]:
    """A ``Forward`` or ``Backward`` reply's one tensor in memory of its own, its bytes, and whether it came inline
    (it did not fit the slice ``dst`` offered). On ``device`` when ``on_device`` and its copy is ordered by an event
    (the host does not wait), else in host memory (pinned when the caller computes on a GPU); ``limits``: the
    client's tensor limits, for an inline reply."""
    name = "hidden" if call == "Forward" else "grad"
    if len(encs) != 1 or encs[0].name != name:
        raise CodecError(f"expected exactly one tensor named {name!r}, got {[e.name for e in encs]}")
    enc = encs[0]
    if enc.region is None:
        from splitfed.channel.wire.messages import decode_single

        return decode_single(encs, name, limits), enc.wire_nbytes, True
    dtype = torch_dtype(enc.dtype)
    if not dtype.is_floating_point:
        raise TensorValueError(f"{name} must be a floating tensor, got {dtype}")
    view = region.reply(enc.region, dst, dtype, tuple(enc.shape))
    if enc.region.event:
        if device is None or region.events is None:
            raise CodecError(f"the server's reply names CUDA event {enc.region.event}, which this call did not offer")
        event = region.events[enc.region.event]
        if on_device:  # the copy waits for the server's, on the GPU
            torch.cuda.current_stream(device).wait_event(event)
            out = torch.empty(view.shape, dtype=dtype, device=device)
            out.copy_(view, non_blocking=True)
            return out, enc.region.nbytes, False
        event.synchronize()
    out = torch.empty(view.shape, dtype=dtype, pin_memory=device is not None)
    copy_into(out, view)
    return out, enc.region.nbytes, False
