"""Shared-memory regions: what crosses the cut skips the socket when client and trunk share a host.

The trunk server creates a region per client on request (:class:`RegionTable`):
a file under ``/dev/shm`` with a random name, opened ``O_EXCL`` and readable
only by the server's user. The client maps it (:class:`ClientRegion`); being
able to is the proof that both run on one host as one user. From then on a
Forward or Backward carries, instead of a tensor's bytes, a
:class:`~splitfed.codec.tensors.RegionRef` (offset and length in the client's region)
and names a slice where the server may write its reply. The gRPC call still
carries every request, so ordering, retries, deadlines, auth and errors stay
the channel's.

Safety: the server only reads and writes regions it created, each bound to the
client that asked for it (another client's region is PERMISSION_DENIED), checks
every slice against the region's bounds, and copies a request's bytes into
memory of its own *before* checking them (NaN/Inf, shapes), so a client writing
into its region during a call cannot change what was checked. The client never
reuses a slice of a call that failed: a reply may still land there, so the
region is dropped and a new one opened.

On a CUDA device both sides register their mapping with CUDA
(``cudaHostRegister``), so device <-> region copies run at pinned-memory speed.
Pure torch and the standard library; knows nothing of gRPC.

This module holds the server's table of regions (:class:`RegionTable`); one
region is :mod:`~splitfed.channel.transports.shm.region`, its CUDA events
:mod:`~splitfed.channel.transports.shm.events`, the host copies
:mod:`~splitfed.channel.transports.shm.hostcopy` (all re-exported here).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections import OrderedDict

import torch

from splitfed.channel.transports.shm import devmem
from splitfed.channel.transports.shm.devmem import DeviceMemory
from splitfed.channel.transports.shm.hostcopy import copy_into, host_copy
from splitfed.channel.transports.shm.events import (
    EVENTS_PER_REGION,
    RegionEvents,
    device_uuid,
    local_events,
    remember_local_events,
)
from splitfed.channel.transports.shm.region import ALIGN, SHM_DIR, SharedRegion, available
from splitfed.codec.tensors import RegionRef
from splitfed.errors import (
    PermissionDeniedError,
    RegionNotFoundError,
    ResourceExhaustedError,
    SharedMemoryUnavailableError,
)

__all__ = [
    "ALIGN", "EVENTS_PER_REGION", "MIN_REGION_TENSOR_BYTES", "SHM_DIR", "RegionEvents", "RegionTable", "SharedRegion",
    "available", "copy_into", "device_uuid", "host_copy", "local_events",
]

log = logging.getLogger(__name__)

#: Tensors smaller than this travel inline: a slice costs more than their bytes.
MIN_REGION_TENSOR_BYTES = 64 << 10


class RegionTable:
    """The server's regions, each bound to the client that opened it.

    Args:
        max_client_bytes: bytes of regions one client may hold; a larger request gets this much, and a
            client's new region closes its oldest ones to stay within it.
        max_total_bytes: bytes of regions all clients may hold together (0: regions are off).
        pin: register regions with CUDA (a trunk on a GPU).
        device_memory: give a region whose copies CUDA events order a twin of the same size in the trunk's GPU
            memory (:mod:`splitfed.channel.transports.shm.devmem`), so those copies stay on the GPU.
        idle_s: a region no call used for this long is closed when another is opened (its client is gone).
    """

    def __init__(self, max_client_bytes: int = 256 << 20, max_total_bytes: int = 4 << 30, pin: bool = False,
                 idle_s: float = 600.0, device_memory: bool = True) -> None:
        self.max_client_bytes = max_client_bytes
        self.max_total_bytes = max_total_bytes
        self.pin = pin
        self.device_memory = device_memory
        self.idle_s = idle_s
        self._regions: OrderedDict[str, tuple[str, SharedRegion]] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """Whether the server offers regions at all."""
        return self.max_total_bytes > 0 and self.max_client_bytes > 0 and available()

    @property
    def total_bytes(self) -> int:
        """Bytes of all open regions."""
        with self._lock:
            return sum(r.nbytes for _, r in self._regions.values())

    def open(self, client: str, nbytes: int, events_on: int | None = None, client_pid: int = 0) -> SharedRegion:
        """A new region of at most ``nbytes`` for ``client``; with CUDA events on device ``events_on`` when given
        (the trunk computes there, and so does the client), and then a twin in GPU memory for a client process
        ``client_pid`` of this user that this server sees (see :mod:`splitfed.channel.transports.shm.devmem`)."""
        if not self.enabled:
            raise SharedMemoryUnavailableError("this trunk server offers no shared memory (trunk-shared-memory-mib "
                                               "= 0, or no /dev/shm); tensors travel over the socket")
        nbytes = min(max(int(nbytes), ALIGN), self.max_client_bytes)
        nbytes = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        with self._lock:
            now = time.monotonic()
            for name in [n for n, (_, r) in self._regions.items() if now - r.used > self.idle_s]:
                self._regions.pop(name)[1].close()
            own = [(name, r) for name, (owner, r) in self._regions.items() if owner == client]
            held = sum(r.nbytes for _, r in own)
            while own and held + nbytes > self.max_client_bytes:
                name, region = own.pop(0)
                held -= region.nbytes
                del self._regions[name]
                region.close()
            total = sum(r.nbytes for _, r in self._regions.values())
            if total + nbytes > self.max_total_bytes:
                raise ResourceExhaustedError(f"shared-memory regions hold {total} bytes; {nbytes} more would pass "
                                             f"the server's limit of {self.max_total_bytes}")
            region = SharedRegion.create(nbytes)
            self._regions[region.name] = (client, region)
        if self.pin:
            region.pin()
        if events_on is not None:
            region.events = RegionEvents.create(events_on)
            remember_local_events(region.name, region.events)
            local = client_pid == os.getpid()
            # Blocks kept for this client's older regions count against its share too.
            room = devmem.parked_bytes(client) + nbytes <= self.max_client_bytes
            if self.device_memory and room and (local or devmem.may_map(client_pid)) and devmem.available():
                try:  # the same size again on the GPU: event-ordered copies stay there
                    region.device_memory = DeviceMemory.allocate(nbytes, events_on, region.name)
                    region.device_client = (client, client_pid, devmem.process_start(client_pid))
                except SharedMemoryUnavailableError as exc:
                    log.info("region %s has no GPU twin (%s): its GPU copies go through host memory", region.name,
                             exc)
        log.debug("opened region %s (%d bytes) for %s", region.name, nbytes, client)
        return region

    def region(self, client: str, name: str) -> SharedRegion:
        """``client``'s region ``name``; NOT_FOUND for an unknown one, PERMISSION_DENIED for another client's."""
        with self._lock:
            entry = self._regions.get(name)
        if entry is None:
            raise RegionNotFoundError(f"region {name!r} is not open on this server (closed when its client left "
                                      "or the server restarted); open a new one")
        owner, region = entry
        if owner != client:
            raise PermissionDeniedError(f"region {name!r} belongs to another client")
        region.unlink()  # its client names it, so it has mapped it
        return region

    def slice(self, client: str, ref: RegionRef) -> torch.Tensor:
        """The bytes ``ref`` names in ``client``'s region (checked)."""
        return self.region(client, ref.region).view(ref.offset, ref.nbytes)

    def close(self, client: str, name: str) -> None:
        """Close one of ``client``'s regions (nothing when it is closed already)."""
        with self._lock:
            entry = self._regions.get(name)
            if entry is None:
                devmem.release(name, client)  # closed already (idle): its GPU memory waited for this
                return
            if entry[0] != client:
                raise PermissionDeniedError(f"region {name!r} belongs to another client")
            del self._regions[name]
        entry[1].close(released=True)

    def close_all(self) -> None:
        """Close every region (the server stops)."""
        with self._lock:
            closing = [r for _, r in self._regions.values()]
            self._regions.clear()
        for region in closing:
            region.close()
