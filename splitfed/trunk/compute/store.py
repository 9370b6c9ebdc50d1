"""Saved forwards: what the trunk keeps between a Forward and its Backward, bounded in time and bytes."""

from __future__ import annotations

import itertools
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
    """Bounds on what the trunk keeps between requests.

    Args:
        ttl_s: seconds a saved forward waits for its Backward before it is evicted.
        max_bytes: bytes all saved state may hold together: saved forwards (activations
            and what autograd saved for the backward), frozen weight copies of rebased
            forwards, and remembered Backward answers. A Forward over it is refused
            (remembered answers are dropped first: they only serve retries).
        max_per_client: saved forwards one client may hold at once.
        done_ttl_s: seconds a completed Backward is remembered to answer retries.
        max_done: completed Backwards remembered at most.
        max_frozen: frozen weight copies kept at most for rebased forwards; making
            one more evicts the forwards that still need the oldest.
    """

    ttl_s: float = 120.0
    max_bytes: int = 4 << 30
    max_per_client: int = 64
    done_ttl_s: float = 60.0
    max_done: int = 1024
    max_frozen: int = 4


@dataclass
class FrozenWeights:
    """A copy of the trainable trunk weights as they were at ``version``, shared by the forwards rebased then."""

    version: int
    params: list[torch.Tensor]
    nbytes: int
    users: set[str] = field(default_factory=set)


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
    frozen: FrozenWeights | None = None
    group: Any = None  # the ForwardGroup of a batched forward, and this client's index in it
    index: int = 0
    weights: list[torch.Tensor] | None = None  # the client's own trunk copy (per-client mode), else None

    @property
    def frozen_params(self) -> list[torch.Tensor] | None:
        """The weights this forward saw, once rebased."""
        return None if self.frozen is None else self.frozen.params


@dataclass
class DoneBackward:
    """A Backward already taken, kept briefly so that a retried request gets the same answer."""

    client_id: str
    grad_in: Any  # a Future of the input gradient
    result: Any  # a Future of the aggregator's Result
    nbytes: int  # what the input gradient holds
    finished: float = field(default_factory=time.monotonic)


class ForwardStore:
    """Saved forwards by activation id, with a TTL, a byte budget and eviction counts.

    ``bytes_held`` counts everything kept between requests: saved forwards,
    frozen weight copies and remembered Backward answers. Not thread-safe on its
    own: the trunk runtime calls it under its lock.
    """

    def __init__(self, limits: StoreLimits = StoreLimits()) -> None:
        self.limits = limits
        self._items: OrderedDict[str, SavedForward] = OrderedDict()
        self._done: OrderedDict[str, DoneBackward] = OrderedDict()
        self._frozen: OrderedDict[int, FrozenWeights] = OrderedDict()  # by id() of the copy, oldest first
        self._per_client: dict[str, int] = {}
        self.forward_bytes = 0
        self.frozen_bytes = 0
        self.done_bytes = 0
        self.evicted = 0
        self._evicted_clients: set[str] = set()

    @property
    def bytes_held(self) -> int:
        """Bytes of saved forwards, frozen weight copies and remembered answers together."""
        return self.forward_bytes + self.frozen_bytes + self.done_bytes

    @property
    def frozen_copies(self) -> int:
        """Frozen weight copies held for rebased forwards."""
        return len(self._frozen)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, activation_id: str) -> bool:
        return activation_id in self._items

    def entries(self) -> list[SavedForward]:
        """Saved forwards, oldest first."""
        return list(self._items.values())

    def admit(self, client_id: str, nbytes: int) -> None:
        """Check that a new forward of ``nbytes`` fits; evict expired entries and old answers first."""
        self.sweep()
        if self._per_client.get(client_id, 0) >= self.limits.max_per_client:
            raise ResourceExhaustedError(
                f"client {client_id} already holds {self.limits.max_per_client} forwards without a backward; "
                "send their backwards (or let them expire) before new training forwards")
        while self._done and self.bytes_held + nbytes > self.limits.max_bytes:
            self._forget_done(next(iter(self._done)))
        if self.bytes_held + nbytes > self.limits.max_bytes:
            raise ResourceExhaustedError(
                f"the trunk holds {self.bytes_held} bytes for pending backwards; {nbytes} more would pass the "
                f"budget of {self.limits.max_bytes}; retry later or use smaller batches")

    def add(self, entry: SavedForward) -> None:
        """Keep ``entry`` until its Backward (or its TTL); one more user of its frozen copy if it ran on one."""
        self._items[entry.activation_id] = entry
        self._per_client[entry.client_id] = self._per_client.get(entry.client_id, 0) + 1
        self.forward_bytes += entry.nbytes
        if entry.frozen is not None:
            entry.frozen.users.add(entry.activation_id)
            self.keep_copy(entry.frozen)

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
        """Remove and return a saved forward (releasing its share of a frozen weight copy)."""
        entry = self._items.pop(activation_id)
        self._per_client[entry.client_id] -= 1
        if not self._per_client[entry.client_id]:
            del self._per_client[entry.client_id]
        self.forward_bytes -= entry.nbytes
        frozen = entry.frozen
        if frozen is not None:
            frozen.users.discard(activation_id)
            self.release_copy(frozen)
        return entry

    # -- frozen weights of rebased forwards ------------------------------------------
    def freeze(self, pending: list[SavedForward], version: int, params: list[torch.Tensor]) -> int:
        """Rebase ``pending`` onto one frozen copy of the weights (``params``, already copied; kept only if some
        forward uses it).

        Returns how many forwards had to be evicted to keep at most
        ``max_frozen`` copies (those that still needed the oldest copy).
        """
        copy = FrozenWeights(version, params, sum(p.numel() * p.element_size() for p in params))
        for entry in pending:
            entry.output = None
            entry.frozen = copy
            copy.users.add(entry.activation_id)
        return self.keep_copy(copy) if pending else 0

    def add_copy(self, version: int, params: list[torch.Tensor]) -> FrozenWeights:
        """A frozen copy of the weights at ``version`` (``params``, already copied), kept for forwards that will
        run on it (:mod:`splitfed.trunk.compute.versions`); see :meth:`keep_copy`."""
        copy = FrozenWeights(version, params, sum(p.numel() * p.element_size() for p in params))
        self.keep_copy(copy)
        return copy

    def keep_copy(self, copy: FrozenWeights) -> int:
        """Count ``copy`` among the frozen copies (once) and keep at most ``max_frozen``: a copy no forward uses
        goes first, then the oldest with the forwards that still need it (evicted). Returns how many forwards
        were evicted."""
        if id(copy) not in self._frozen:
            self._frozen[id(copy)] = copy
            self.frozen_bytes += copy.nbytes
        evicted = 0
        while len(self._frozen) > max(self.limits.max_frozen, 1):
            unused = next((c for c in self._frozen.values() if not c.users and c is not copy), None)
            if unused is not None:
                self.release_copy(unused)
                continue
            oldest = next((c for c in self._frozen.values() if c.users), None)
            if oldest is None:  # only ``copy`` is left without users: nothing to evict
                break
            for activation_id in list(oldest.users):
                entry = self.pop(activation_id)
                evicted += 1
                self._evicted_clients.add(entry.client_id)
                log.warning("evicted forward %s of client %s: it saw trunk version %d, older than the %d frozen "
                            "weight copies the server keeps", activation_id, entry.client_id, oldest.version,
                            self.limits.max_frozen)
        self.evicted += evicted
        return evicted

    def release_copy(self, copy: FrozenWeights) -> None:
        """Stop counting ``copy`` if no forward uses it."""
        if not copy.users and self._frozen.pop(id(copy), None) is not None:
            self.frozen_bytes -= copy.nbytes

    # -- remembered answers ---------------------------------------------------------------
    def remember(self, activation_id: str, done: DoneBackward) -> None:
        """Keep a completed Backward's answer for retries (bounded in count, bytes and time)."""
        if activation_id in self._done:
            self._forget_done(activation_id)
        self._done[activation_id] = done
        self.done_bytes += done.nbytes
        while len(self._done) > self.limits.max_done or (len(self._done) > 1 and
                                                          self.bytes_held > self.limits.max_bytes):
            self._forget_done(next(iter(self._done)))

    def _forget_done(self, activation_id: str) -> None:
        done = self._done.pop(activation_id)
        self.done_bytes -= done.nbytes

    def done(self, activation_id: str) -> DoneBackward | None:
        """A remembered completed Backward, if still held."""
        return self._done.get(activation_id)

    def sweep(self, now: float | None = None) -> int:
        """Evict saved forwards older than the TTL and old answers; return how many forwards were evicted.

        Both are kept oldest first (each is made and kept under the runtime's lock), so only the expired ones
        at the front are looked at: a sweep costs what it evicts, not what is held (every forward sweeps).
        """
        now = time.monotonic() if now is None else now
        evicted = 0
        expired = itertools.takewhile(lambda item: now - item[1].created > self.limits.ttl_s, self._items.items())
        for key in [k for k, _ in expired]:
            entry = self.pop(key)
            evicted += 1
            self._evicted_clients.add(entry.client_id)
            log.warning("evicted forward %s of client %s: no backward within %.1fs", key, entry.client_id,
                        self.limits.ttl_s)
        old = itertools.takewhile(lambda item: now - item[1].finished > self.limits.done_ttl_s, self._done.items())
        for key in [k for k, _ in old]:
            self._forget_done(key)
        self.evicted += evicted
        return evicted

    def holds(self, client_id: str) -> bool:
        """Whether ``client_id`` has a saved forward waiting for its backward."""
        return client_id in self._per_client

    def clients(self) -> set[str]:
        """Every client with a saved forward waiting for its backward."""
        return set(self._per_client)

    def take_evicted_clients(self) -> set[str]:
        """Clients that lost a saved forward to eviction since the last call and hold none now."""
        gone = {c for c in self._evicted_clients if c not in self._per_client}
        self._evicted_clients.clear()
        return gone

    def drop_client(self, client_id: str) -> int:
        """Evict every saved forward of one client (it left or was dropped)."""
        keys = [k for k, e in self._items.items() if e.client_id == client_id]
        for key in keys:
            self.pop(key)
        self.evicted += len(keys)
        return len(keys)
