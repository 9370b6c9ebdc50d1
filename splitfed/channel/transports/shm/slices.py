"""A client's view of its shared-memory region: the slices and CUDA events its calls in flight hold.

Pure torch and the standard library (see :mod:`splitfed.channel.transports.shm.regions` for the regions themselves).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from splitfed.channel.transports.shm.devmem import DeviceMemory
from splitfed.channel.transports.shm.regions import ALIGN, RegionEvents, SharedRegion
from splitfed.codec.tensors import RegionRef
from splitfed.errors import CodecError


def aligned(nbytes: int) -> int:
    """The bytes a slice of ``nbytes`` takes in a region: whole blocks of :data:`~splitfed.channel.transports.shm.regions.ALIGN`."""
    return -(-max(nbytes, 1) // ALIGN) * ALIGN


@dataclass
class _Slices:
    """A first-fit allocator of aligned slices in ``[0, size)``."""

    size: int
    free: list[tuple[int, int]] = field(default_factory=list)  # (offset, length), sorted by offset

    def __post_init__(self) -> None:
        self.free = [(0, self.size)]

    def take(self, nbytes: int) -> int | None:
        need = aligned(nbytes)
        for i, (offset, length) in enumerate(self.free):
            if length >= need:
                if length == need:
                    del self.free[i]
                else:
                    self.free[i] = (offset + need, length - need)
                return offset
        return None

    def give(self, offset: int, nbytes: int) -> None:
        need = aligned(nbytes)
        self.free.append((offset, need))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for off, length in self.free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((off, length))
        self.free = merged


@dataclass
class Slice:
    """A slice of a client's region, taken for one call."""

    region: ClientRegion
    offset: int
    nbytes: int
    #: Whether the call uses the slice in the region's GPU memory rather than in its file.
    device: bool = False

    @property
    def ref(self) -> RegionRef:
        """How a message names it (without an event)."""
        return RegionRef(self.region.name, self.offset, self.nbytes, device=self.device)

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...], device: bool = False) -> torch.Tensor:
        """The slice's first bytes viewed as a C-contiguous tensor of ``dtype`` and ``shape``: in the region's file,
        or in its GPU memory when ``device``."""
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        memory = self.region.device_memory if device else None
        if device and memory is None:
            raise CodecError(f"region {self.region.name} has no GPU memory")
        raw = memory.view(self.offset, nbytes) if memory is not None else self.region.mapping.view(self.offset, nbytes)
        return raw.view(dtype).view(shape)


class ClientRegion:
    """A client's mapping of its region, with the slices its calls in flight hold."""

    def __init__(self, mapping: SharedRegion, events: RegionEvents | None = None, events_uuid: str = "",
                 device_memory: DeviceMemory | None = None) -> None:
        self.mapping = mapping
        self.name = mapping.name
        #: The server's CUDA events for this region (None: copies complete before a call is sent), and the UUID
        #: of the GPU they belong to.
        self.events = events
        self.events_uuid = events_uuid
        #: The region's twin in the trunk's GPU memory, mapped here (None: event-ordered copies go through the
        #: file): slices of event-ordered calls lie there.
        self.device_memory = device_memory
        self._uuids: dict[int, str] = {}
        self._slices = _Slices(mapping.nbytes)
        self._free_events = list(range(len(events), 0, -1)) if events is not None else []
        self._lock = threading.Lock()
        self.broken = False
        #: The engine's direct-call link that came with this region (a
        #: :class:`~splitfed.channel.transports.direct.client.DirectLink`; None: its calls go over gRPC).
        self.direct: Any = None

    def take(self, nbytes: int, device: bool = False) -> Slice | None:
        """A slice of ``nbytes`` (used in the region's GPU memory when ``device``), or None when the region has no
        room (the tensor then travels inline)."""
        with self._lock:
            if self.broken:
                return None
            offset = self._slices.take(nbytes)
        return None if offset is None else Slice(self, offset, nbytes, device)

    def give(self, piece: Slice) -> None:
        """Return a slice once its call succeeded (a failed call's slices are never reused: see :meth:`poison`)."""
        with self._lock:
            self._slices.give(piece.offset, piece.nbytes)

    def orders(self, device: torch.device) -> bool:
        """Whether this region's events can order copies from a tensor on ``device`` (the events' own GPU)."""
        if self.events is None or device.type != "cuda" or not self.events_uuid:
            return False
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._uuids:
            from splitfed.channel.transports.shm.regions import device_uuid

            self._uuids[index] = device_uuid(index)
        return self._uuids[index] == self.events_uuid

    def take_events(self) -> tuple[int, int] | None:
        """Two event indices (request, reply) for one call, or None when all are in use."""
        with self._lock:
            if len(self._free_events) < 2 or self.broken:
                return None
            return self._free_events.pop(), self._free_events.pop()

    def give_events(self, pair: tuple[int, int]) -> None:
        """Return a call's events (only once the call succeeded, like slices)."""
        with self._lock:
            self._free_events.extend(pair)

    def retire_if_idle(self) -> bool:
        """Stop taking slices if no call holds a slice or an event of this region (it can then be closed at once);
        returns whether it did."""
        with self._lock:
            idle = self._slices.free == [(0, self._slices.size)] and \
                len(self._free_events) == (len(self.events) if self.events is not None else 0)
            if idle:
                self.broken = True
            return idle

    def poison(self) -> None:
        """Stop using this region: a call failed, and the server may still write into its slices."""
        with self._lock:
            self.broken = True

    def reply(self, ref: RegionRef, given: Slice, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The reply tensor the server wrote into ``given``; raises :class:`CodecError` if ``ref`` lies elsewhere."""
        need = dtype.itemsize
        for d in shape:
            need *= d
        if ref.region != self.name or ref.offset != given.offset or ref.nbytes > given.nbytes or ref.nbytes != need \
                or ref.device != given.device:
            raise CodecError(f"the server's reply names slice {ref} but was given {given.ref} for {need} bytes")
        return given.tensor(dtype, shape, device=ref.device)

    def pin(self) -> bool:
        """Register the mapping with CUDA (see :meth:`SharedRegion.pin`)."""
        return self.mapping.pin()

    def close(self) -> None:
        """Unmap the region (and its GPU memory), and close its direct-call link."""
        if self.direct is not None:
            self.direct.close()
        self.mapping.close()
        if self.device_memory is not None:
            torch.cuda.synchronize(self.device_memory.device)  # no copy may still use the mapping when it goes
            self.device_memory.close()
            self.device_memory = None
