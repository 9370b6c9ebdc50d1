"""One shared-memory region: its file under ``/dev/shm``, its mapping, CUDA pinning, and a close that waits.

The server creates a region (:meth:`SharedRegion.create`), its client maps it
(:meth:`SharedRegion.attach`); :mod:`splitfed.channel.transports.shm.regions` says how the
server hands them out. Pure torch and the standard library.
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
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from splitfed.channel.transports.shm import devmem
from splitfed.channel.transports.shm.devmem import DeviceMemory
from splitfed.channel.transports.shm.events import RegionEvents, forget_local_events
from splitfed.codec.tensors import RegionRef
from splitfed.errors import (
    CodecError,
    ResourceExhaustedError,
    SharedMemoryUnavailableError,
)

__all__ = ["ALIGN", "SHM_DIR", "SharedRegion", "available"]

log = logging.getLogger(__name__)

#: Where regions live (a tmpfs on Linux).
SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^splitfed-[0-9a-f]{32}$")
#: Slices start on this boundary (any dtype can view them, copies stay aligned).
ALIGN = 256


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
        self._map: mmap.mmap | None = mapping
        # Through numpy, whose array holds the mapping's buffer for as long as it lives: a tensor viewing these
        # bytes (a reply being written, a request being read) keeps them mapped after :meth:`close`, which then
        # cannot unmap them under it. ``torch.frombuffer`` lets the buffer go at once, and a write through a view
        # after ``close`` hit unmapped memory and killed the process.
        self.bytes = torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8))
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
        while True:  # a reader may start a copy and hold its event until it leaves: wait for both, then unregister
            with self._lock:
                while self._readers:
                    self._idle.wait()
                inflight, self._inflight = self._inflight, []
                if not inflight:
                    if self._registered:
                        torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
                        self._registered = False
                    break
            for event in inflight:
                event.synchronize()
        self.bytes = torch.empty(0, dtype=torch.uint8)
        try:
            if self._map is not None:
                self._map.close()
        except BufferError:  # a tensor still views it: the mapping goes with the last view (see __init__)
            self._map = None  # only the views hold it now
        if self.owner:
            self.path.unlink(missing_ok=True)
            forget_local_events(self.name)
        if self.device_memory is not None:
            devmem.retire(self.name, self.device_memory, *self.device_client, released=released)
            self.device_memory = None
