"""Copies across the host/device boundary at the cut, off the compute stream: pinned, reused buffers.

What crosses the cut is encoded from host memory and decoded into host memory.
On a GPU, a plain ``tensor.cpu()`` waits for every kernel queued so far and
copies through a pageable bounce buffer; ``tensor.to("cuda")`` from pageable
memory blocks the host likewise. :class:`Staging` instead

* copies device -> host into a *pinned* buffer on a side CUDA stream that
  waits (by event) only for the work that produced the tensor, and hands back
  the host tensor with a :class:`HostCopy` whose :meth:`HostCopy.wait` the
  *sending* thread calls: the compute thread goes on queueing the next
  micro-batch while the copy and the send proceed;
* copies host -> device from a pinned buffer on the side stream, and makes the
  compute stream wait for it by event (the host does not wait);
* reuses its pinned buffers by shape and dtype (pinning is slow), each buffer
  back in the pool once the copy that used it is done and the caller released it.

On the CPU nothing is copied: :meth:`Staging.to_host` returns the tensor itself.
Pure torch; knows nothing of the channel.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

#: Counts of copies made here, by kind (``d2h``, ``h2d``, ``cast``, ``own``): tests read them.
COPIES: dict[str, int] = {"d2h": 0, "h2d": 0, "cast": 0, "own": 0}
_count_lock = threading.Lock()


def count_copy(kind: str) -> None:
    """Count one copy of ``kind`` in :data:`COPIES`."""
    with _count_lock:
        COPIES[kind] = COPIES.get(kind, 0) + 1


@dataclass
class HostCopy:
    """A host tensor that a device -> host copy is filling: :meth:`wait` before reading it, :meth:`release`
    once nothing reads it any more (its pinned buffer goes back to the pool)."""

    tensor: torch.Tensor
    event: torch.cuda.Event | None = None
    on_release: Callable[[], None] | None = None
    released: bool = field(default=False)

    def wait(self) -> torch.Tensor:
        """Block until the copy is done; returns the host tensor."""
        if self.event is not None:
            self.event.synchronize()
        return self.tensor

    def release(self) -> None:
        """Give the pinned buffer back (idempotent)."""
        if not self.released and self.on_release is not None:
            self.released = True
            self.on_release()


class Staging:
    """Host <-> device copies for one device, on a side stream, from pinned reused buffers.

    Args:
        device: the device the client parts compute on; CPU makes every method a no-op.
        max_buffers: pinned buffers kept per shape and dtype.
    """

    def __init__(self, device: torch.device | str, max_buffers: int = 8) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.max_buffers = max_buffers
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self._inflight: list[tuple[torch.cuda.Event, torch.Tensor]] = []  # h2d sources still being read
        self._lock = threading.Lock()

    # -- pinned buffers -----------------------------------------------------------------
    def _take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            self._reclaim()
            free = self._free.get((shape, dtype))
            if free:
                return free.pop()
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def _give(self, buf: torch.Tensor) -> None:
        with self._lock:
            free = self._free.setdefault((tuple(buf.shape), buf.dtype), [])
            if len(free) < self.max_buffers:
                free.append(buf)

    def _reclaim(self) -> None:
        done = [(e, b) for e, b in self._inflight if e.query()]
        if done:
            self._inflight = [(e, b) for e, b in self._inflight if not e.query()]
            for _, buf in done:
                free = self._free.setdefault((tuple(buf.shape), buf.dtype), [])
                if len(free) < self.max_buffers:
                    free.append(buf)

    @property
    def pooled(self) -> int:
        """Pinned buffers waiting in the pool."""
        with self._lock:
            return sum(len(v) for v in self._free.values())

    # -- copies --------------------------------------------------------------------------
    def to_host(self, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> HostCopy:
        """``tensor`` (detached) in host memory, cast to ``dtype`` on the device first (fewer bytes to copy).

        On the CPU the tensor itself (cast if asked). On CUDA the copy runs on
        the side stream after the work that produced ``tensor``; call
        :meth:`HostCopy.wait` before reading, :meth:`HostCopy.release` after.
        """
        t = tensor.detach()
        if dtype is not None and t.dtype != dtype and t.is_floating_point():
            t = t.to(dtype)
            count_copy("cast")
        if not self.cuda or t.device.type != "cuda":
            return HostCopy(t)
        assert self._stream is not None
        t = t.contiguous()
        buf = self._take(tuple(t.shape), t.dtype)
        self._stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self._stream):
            buf.copy_(t, non_blocking=True)
            t.record_stream(self._stream)  # the compute stream may reuse t's memory only after the copy
            event = torch.cuda.Event()
            event.record(self._stream)
        count_copy("d2h")
        return HostCopy(buf, event, lambda: self._give(buf))

    def to_device(self, host: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``host`` on this device (cast to ``dtype``), in memory of its own.

        On the CPU: a copy only where one is needed (a cast, or ``host`` views
        read-only bytes, e.g. a decoded reply). On CUDA: host -> pinned buffer ->
        device on the side stream; the compute stream waits by event, the host
        does not.
        """
        dtype = dtype or host.dtype
        if not self.cuda:
            if host.dtype != dtype:
                count_copy("cast")
                return host.to(dtype)
            count_copy("own")  # decoded tensors view read-only reply bytes: the parts get memory of their own
            return host.clone()
        assert self._stream is not None
        if host.device.type != "cpu":  # already on a device: nothing to stage
            return host.to(self.device, dtype)
        buf = self._take(tuple(host.shape), host.dtype)
        buf.copy_(host)
        with torch.cuda.stream(self._stream):
            out = buf.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        count_copy("h2d")
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        out.record_stream(current)
        with self._lock:
            self._inflight.append((event, buf))
        if out.dtype != dtype:
            count_copy("cast")
            out = out.to(dtype)
        return out
