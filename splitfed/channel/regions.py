"""Shared-memory regions: what crosses the cut skips the socket when client and trunk share a host.

The trunk server creates a region per client on request (:class:`RegionTable`):
a file under ``/dev/shm`` with a random name, opened ``O_EXCL`` and readable
only by the server's user. The client maps it (:class:`ClientRegion`); being
able to is the proof that both run on one host as one user. From then on a
Forward or Backward carries, instead of a tensor's bytes, a
:class:`~splitfed.codec.RegionRef` (offset and length in the client's region)
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
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from splitfed.channel import devmem
from splitfed.channel.devmem import DeviceMemory
from splitfed.codec import RegionRef
from splitfed.errors import (
    CodecError,
    PermissionDeniedError,
    RegionNotFoundError,
    ResourceExhaustedError,
    SharedMemoryUnavailableError,
)

log = logging.getLogger(__name__)

#: Where regions live (a tmpfs on Linux).
SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^splitfed-[0-9a-f]{32}$")
#: Slices start on this boundary (any dtype can view them, copies stay aligned).
ALIGN = 256
#: Tensors smaller than this travel inline: a slice costs more than their bytes.
MIN_REGION_TENSOR_BYTES = 64 << 10


def available() -> bool:
    """Whether this host can create shared-memory regions."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


class SharedRegion:
    """One mapping of a region's file; :attr:`bytes` is a uint8 tensor over all of it."""

    def __init__(self, name: str, path: Path, mapping: mmap.mmap, nbytes: int, owner: bool) -> None:
        self.name = name
        self.path = path
        self.nbytes = nbytes
        self.owner = owner
        self._map = mapping
        self.bytes = torch.frombuffer(mapping, dtype=torch.uint8)
        #: CUDA events ordering copies of its slices (None: copies complete before a call is sent).
        self.events: RegionEvents | None = None
        #: Its twin in the trunk's GPU memory, where event-ordered slices may lie (None: there is none), and who
        #: maps it: (client, process id, process start).
        self.device_memory: DeviceMemory | None = None
        self.device_client: tuple[str, int, str | None] = ("", 0, None)
        self._registered = False
        #: Why registering with CUDA failed (None: it did not, or was not tried).
        self.pin_error: str | None = None
        self._lock = threading.Lock()
        #: When a slice of it was last used (``time.monotonic``).
        self.used = time.monotonic()
        self._unlinked = False
        self._inflight: list[torch.cuda.Event] = []  # asynchronous copies that read or write its memory
        self._readers = 0  # copies reading it right now (see :meth:`reading`)
        self._idle = threading.Condition(self._lock)

    @classmethod
    def create(cls, nbytes: int) -> SharedRegion:
        """A new region of ``nbytes`` (the server's side)."""
        if not available():
            raise SharedMemoryUnavailableError(f"{SHM_DIR} is not writable here; tensors travel over the socket")
        name = f"splitfed-{secrets.token_hex(16)}"
        path = SHM_DIR / name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # Reserve the pages now: a tmpfs that runs out of room later (a container's small /dev/shm) would
            # kill the process that touches the missing page instead of failing here.
            os.posix_fallocate(fd, 0, nbytes)
            mapping = mmap.mmap(fd, nbytes)
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise ResourceExhaustedError(f"could not create a shared-memory region of {nbytes} bytes: {exc}") from None
        finally:
            os.close(fd)
        return cls(name, path, mapping, nbytes, owner=True)

    @classmethod
    def attach(cls, name: str, nbytes: int) -> SharedRegion:
        """Map the region a server created (the client's side); raises :class:`SharedMemoryUnavailableError`
        when it cannot be opened (the server is on another host, or runs as another user)."""
        if not _NAME.match(name):
            raise SharedMemoryUnavailableError(f"the server named a region {name!r} that is not a splitfed region")
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise SharedMemoryUnavailableError(f"cannot open region {path} ({exc.strerror}): the trunk server runs "
                                               "on another host or as another user") from None
        try:
            size = os.fstat(fd).st_size
            if size != nbytes:
                raise SharedMemoryUnavailableError(f"region {name} has {size} bytes, the server said {nbytes}")
            mapping = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        return cls(name, path, mapping, nbytes, owner=False)

    def pin(self) -> bool:
        """Register the mapping with CUDA (once), so copies to and from a GPU run at pinned speed."""
        with self._lock:
            if self._registered or self.pin_error is not None or not torch.cuda.is_available():
                return self._registered
            # Portable: pinned for every GPU's context, so a client on another GPU than the trunk copies at
            # pinned speed too.
            err = torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), self.nbytes, _HOST_REGISTER_PORTABLE)
            self._registered = int(err) == 0
            if not self._registered:
                self.pin_error = str(err)
                log.info("cudaHostRegister of region %s failed (%s); copies run at pageable speed", self.name, err)
            return self._registered

    def unlink(self) -> None:
        """Remove the region's file (the side that created it), keeping the mappings: once its client has mapped
        it, nothing needs the name, and a server that dies leaves nothing behind in ``/dev/shm``."""
        if self.owner and not self._unlinked:
            self._unlinked = True
            self.path.unlink(missing_ok=True)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes ``[offset, offset + nbytes)``; raises :class:`CodecError` past the region's end."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise CodecError(f"slice [{offset}, {offset + nbytes}) lies outside region {self.name} of "
                             f"{self.nbytes} bytes")
        self.used = time.monotonic()
        return self.bytes[offset:offset + nbytes]

    def where(self, ref: RegionRef) -> torch.Tensor:
        """The bytes ``ref`` names: in the region's GPU memory when ``ref.device``, else in its file (checked)."""
        if not ref.device:
            return self.view(ref.offset, ref.nbytes)
        if self.device_memory is None or not ref.event:
            raise CodecError(f"slice names region {self.name}'s GPU memory, which it has none of (or without an "
                             "event ordering the copy)")
        self.used = time.monotonic()
        return self.device_memory.view(ref.offset, ref.nbytes)

    @property
    def registered(self) -> bool:
        """Whether the mapping is registered with CUDA (copies to and from a GPU run asynchronously)."""
        return self._registered

    def hold(self, event: torch.cuda.Event) -> None:
        """An asynchronous copy to or from its memory ends with ``event``: :meth:`close` waits for it."""
        with self._lock:
            self._inflight = [e for e in self._inflight if not e.query()]
            self._inflight.append(event)

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Keep the mapping registered and in place while a copy reads it (:meth:`close` waits)."""
        with self._lock:
            self._readers += 1
        try:
            yield
        finally:
            with self._lock:
                self._readers -= 1
                if not self._readers:
                    self._idle.notify_all()

    def close(self, released: bool = False) -> None:
        """Unmap (and, on the side that created it, delete the file) once the copies in flight there are done.
        ``released``: the client closed it first, so its GPU memory is free to go (else it waits for the client's
        process, see :func:`devmem.retire`)."""
        with self._lock:
            inflight, self._inflight = self._inflight, []
        for event in inflight:
            event.synchronize()
        with self._lock:
            while self._readers:
                self._idle.wait()
            if self._registered:
                torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
                self._registered = False
        self.bytes = torch.empty(0, dtype=torch.uint8)
        try:
            self._map.close()
        except BufferError:  # a tensor still views it: the mapping goes with the last view
            pass
        if self.owner:
            self.path.unlink(missing_ok=True)
            _LOCAL_EVENTS.pop(self.name, None)
        if self.device_memory is not None:
            devmem.retire(self.name, self.device_memory, *self.device_client, released=released)
            self.device_memory = None


#: CUDA events per region: slices of calls in flight at once name one each.
EVENTS_PER_REGION = 64
_LOCAL_EVENTS: dict[str, RegionEvents] = {}  # by region name: a client in the server's process uses them as they are


class RegionEvents:
    """Interprocess CUDA events that order the copies into and out of a region without the host waiting.

    The writer of a slice queues its copy, records an event on its stream and sends the call; the reader's
    stream waits for that event before its own copy. Indices on the wire are 1-based.
    """

    def __init__(self, events: list[torch.cuda.Event], device: int) -> None:
        self.events = events
        self.device = device

    @classmethod
    def create(cls, device: int, count: int = EVENTS_PER_REGION) -> RegionEvents:
        """New events on ``device`` (the server's side)."""
        with torch.cuda.device(device):
            return cls([torch.cuda.Event(interprocess=True) for _ in range(count)], device)

    @classmethod
    def open(cls, device: int, handles: list[bytes]) -> RegionEvents:
        """The server's events, from their IPC handles (a client in another process)."""
        try:
            return cls([torch.cuda.Event.from_ipc_handle(device, h) for h in handles], device)
        except RuntimeError as exc:
            raise SharedMemoryUnavailableError(f"cannot open the trunk server's CUDA events: {exc}") from None

    def handles(self) -> list[bytes]:
        """The events' IPC handles."""
        return [bytes(e.ipc_handle()) for e in self.events]

    def __len__(self) -> int:
        return len(self.events)

    def __getitem__(self, index: int) -> torch.cuda.Event:
        """Event ``index`` (1-based); raises :class:`CodecError` for one the region does not have."""
        if not 1 <= index <= len(self.events):
            raise CodecError(f"event {index} is not one of the region's {len(self.events)} events")
        return self.events[index - 1]


def device_uuid(device: torch.device | int) -> str:
    """The UUID of a CUDA device ("" when it cannot be told): the same GPU has the same UUID in every process,
    whatever the device numbering there."""
    try:
        return str(torch.cuda.get_device_properties(device).uuid)
    except (AttributeError, RuntimeError, AssertionError):
        return ""


def local_events(name: str) -> RegionEvents | None:
    """The events of region ``name`` when its server runs in this process."""
    return _LOCAL_EVENTS.get(name)


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


class RegionTable:
    """The server's regions, each bound to the client that opened it.

    Args:
        max_client_bytes: bytes of regions one client may hold; a larger request gets this much, and a
            client's new region closes its oldest ones to stay within it.
        max_total_bytes: bytes of regions all clients may hold together (0: regions are off).
        pin: register regions with CUDA (a trunk on a GPU).
        device_memory: give a region whose copies CUDA events order a twin of the same size in the trunk's GPU
            memory (:mod:`splitfed.channel.devmem`), so those copies stay on the GPU.
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
        ``client_pid`` of this user that this server sees (see :mod:`splitfed.channel.devmem`)."""
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
            _LOCAL_EVENTS[region.name] = region.events
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
