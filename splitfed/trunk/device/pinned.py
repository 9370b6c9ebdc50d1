"""Pinned host buffers reused by size class (:class:`PinnedPool`): pinning is slow (the CUDA call that allocates
one took 3 ms on an H100 host), so the copies at a GPU trunk's cut take theirs from a pool."""

from __future__ import annotations

import threading

import torch

#: Pinned buffers come in sizes of powers of two from this many bytes up.
MIN_BUFFER = 1 << 16


def _size_class(nbytes: int) -> int:
    return max(MIN_BUFFER, 1 << (max(nbytes, 1) - 1).bit_length())


class PinnedPool:
    """Pinned host buffers (uint8) reused by size class; at most ``max_bytes`` kept idle.

    A buffer given back with the event of the last copy that uses it is reused only once that event completed,
    so a copy still in flight never sees its buffer handed to someone else.
    """

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._pending: list[tuple[torch.cuda.Event, torch.Tensor]] = []
        self._idle = 0
        self._lock = threading.Lock()
        self.allocated = 0  # buffers pinned so far (tests and benchmarks read it)

    def take(self, nbytes: int) -> torch.Tensor:
        """A pinned buffer of at least ``nbytes`` bytes (its first ``nbytes`` are the caller's)."""
        size = _size_class(nbytes)
        with self._lock:
            self._reclaim()
            free = self._free.get(size)
            if free:
                self._idle -= size
                return free.pop()
            self.allocated += 1
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def give(self, buf: torch.Tensor, after: torch.cuda.Event | None = None) -> None:
        """Put ``buf`` back, to be reused once ``after`` (the last copy using it) completed."""
        with self._lock:
            if after is not None and not after.query():
                self._pending.append((after, buf))
                return
            self._keep(buf)

    def _keep(self, buf: torch.Tensor) -> None:
        size = buf.numel()
        if self._idle + size <= self.max_bytes:
            self._free.setdefault(size, []).append(buf)
            self._idle += size

    def _reclaim(self) -> None:
        if not self._pending:
            return
        still = []
        for event, buf in self._pending:
            if event.query():
                self._keep(buf)
            else:
                still.append((event, buf))
        self._pending = still


__all__ = ["MIN_BUFFER", "PinnedPool"]
