"""Saved forwards: what the trunk keeps between a Forward and its Backward, bounded in time and bytes."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from splitfed.errors import (
    ActivationNotFoundError,
    ActivationStateError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from splitfed.split.base import CutState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreLimits:
    """Bounds on saved forwards.

    Args:
        ttl_s: seconds a saved forward waits for its Backward before it is evicted.
        max_bytes: bytes all saved forwards may hold together (activations and
            what autograd saved for the backward); a Forward over it is refused.
        max_per_client: saved forwards one client may hold at once.
        done_ttl_s: seconds a completed Backward is remembered to answer retries.
        max_done: completed Backwards remembered at most.
    """

    ttl_s: float = 120.0
    max_bytes: int = 4 << 30
    max_per_client: int = 64
    done_ttl_s: float = 60.0
    max_done: int = 1024


@dataclass
class SavedForward:
    """One training forward waiting for its Backward."""

    activation_id: str
    client_id: str
    version: int
    inputs: CutState
    output: torch.Tensor | None  # None once rebased: recompute from frozen_params
    out_value: torch.Tensor
    nbytes: int
    num_examples: int
    rng_state: Any
    created: float = field(default_factory=time.monotonic)
    frozen_params: list[torch.Tensor] | None = None


@dataclass
class DoneBackward:
    """A completed Backward, kept briefly so that a retried request gets the same answer."""

    client_id: str
    grad_in: torch.Tensor
    result: Any
    finished: float = field(default_factory=time.monotonic)


class ForwardStore:
    """Saved forwards by activation id, with a TTL, a byte budget and eviction counts.

    Not thread-safe on its own: the trunk runtime calls it under its lock.
    """

    def __init__(self, limits: StoreLimits = StoreLimits()) -> None:
        self.limits = limits
        self._items: OrderedDict[str, SavedForward] = OrderedDict()
        self._done: OrderedDict[str, DoneBackward] = OrderedDict()
        self._per_client: dict[str, int] = {}
        self.bytes_held = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, activation_id: str) -> bool:
        return activation_id in self._items

    def entries(self) -> list[SavedForward]:
        """Saved forwards, oldest first."""
        return list(self._items.values())

    def admit(self, client_id: str, nbytes: int) -> None:
        """Check that a new forward of ``nbytes`` fits; evict expired entries first."""
        self.sweep()
        if self._per_client.get(client_id, 0) >= self.limits.max_per_client:
            raise ResourceExhaustedError(
                f"client {client_id} already holds {self.limits.max_per_client} forwards without a backward; "
                "send their backwards (or let them expire) before new training forwards")
        if self.bytes_held + nbytes > self.limits.max_bytes:
            raise ResourceExhaustedError(
                f"saved forwards hold {self.bytes_held} bytes; {nbytes} more would pass the budget of "
                f"{self.limits.max_bytes}; retry later or use smaller batches")

    def add(self, entry: SavedForward) -> None:
        """Keep ``entry`` until its Backward (or its TTL)."""
        self._items[entry.activation_id] = entry
        self._per_client[entry.client_id] = self._per_client.get(entry.client_id, 0) + 1
        self.bytes_held += entry.nbytes

    def find(self, activation_id: str) -> SavedForward | None:
        """The saved forward with this id, if held."""
        return self._items.get(activation_id)

    def get(self, activation_id: str, client_id: str) -> SavedForward:
        """The saved forward for a Backward from ``client_id``, with precise errors."""
        entry = self._items.get(activation_id)
        if entry is None:
            done = self._done.get(activation_id)
            if done is not None:
                if done.client_id != client_id:
                    raise PermissionDeniedError(f"activation {activation_id} belongs to another client")
                raise ActivationStateError(f"activation {activation_id} already received its backward; "
                                           "each forward takes exactly one backward")
            raise ActivationNotFoundError(
                f"no saved forward {activation_id!r}: unknown, or evicted after {self.limits.ttl_s}s; "
                "run the forward again")
        if entry.client_id != client_id:
            raise PermissionDeniedError(f"activation {activation_id} belongs to another client")
        return entry

    def pop(self, activation_id: str) -> SavedForward:
        """Remove and return a saved forward."""
        entry = self._items.pop(activation_id)
        self._per_client[entry.client_id] -= 1
        if not self._per_client[entry.client_id]:
            del self._per_client[entry.client_id]
        self.bytes_held -= entry.nbytes
        return entry

    def remember(self, activation_id: str, done: DoneBackward) -> None:
        """Keep a completed Backward's answer for retries (bounded count and TTL)."""
        self._done[activation_id] = done
        while len(self._done) > self.limits.max_done:
            self._done.popitem(last=False)

    def done(self, activation_id: str) -> DoneBackward | None:
        """A remembered completed Backward, if still held."""
        return self._done.get(activation_id)

    def sweep(self, now: float | None = None) -> int:
        """Evict saved forwards older than the TTL; return how many were evicted."""
        now = time.monotonic() if now is None else now
        evicted = 0
        for key in [k for k, e in self._items.items() if now - e.created > self.limits.ttl_s]:
            entry = self.pop(key)
            evicted += 1
            log.warning("evicted forward %s of client %s: no backward within %.1fs", key, entry.client_id,
                        self.limits.ttl_s)
        for key in [k for k, d in self._done.items() if now - d.finished > self.limits.done_ttl_s]:
            del self._done[key]
        self.evicted += evicted
        return evicted

    def drop_client(self, client_id: str) -> int:
        """Evict every saved forward of one client (it left or was dropped)."""
        keys = [k for k, e in self._items.items() if e.client_id == client_id]
        for key in keys:
            self.pop(key)
        self.evicted += len(keys)
        return len(keys)
