"""A shared-memory call's copies: its tensors into the region's slices, and the slices given back once it succeeded."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import torch

from splitfed.channel.transports.shm.regions import copy_into
from splitfed.channel.transports.shm.slices import ClientRegion, Slice
from splitfed.codec.tensors import EncodedTensor, WireDType, torch_dtype
from splitfed.errors import ChannelError


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
