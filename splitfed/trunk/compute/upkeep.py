"""Upkeep of the trunk runtime: dropping undelivered forwards, sweeping expired state, deadlines, checkpoints.

A mixin of :class:`splitfed.trunk.compute.runtime.TrunkRuntime`: these methods use its
lock, store, aggregator and optimizer, and are kept apart from the forward and
backward paths.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from splitfed.trunk.aggregation.modes import TrunkAggregator
from splitfed.trunk.aggregation.microsteps import StepPart
from splitfed.trunk.compute.requests import BackwardResult
from splitfed.trunk.compute.store import ForwardStore

if TYPE_CHECKING:
    from splitfed.trunk.compute.batched import Batcher

T = TypeVar("T")


class RuntimeUpkeep:
    """Housekeeping and checkpoint state of a trunk runtime (see :class:`~splitfed.trunk.compute.runtime.TrunkRuntime`)."""

    trunk: nn.Module
    optimizer: torch.optim.Optimizer | None
    aggregator: TrunkAggregator
    store: ForwardStore
    _lock: threading.RLock
    _version: int
    _batches: Batcher
    start_backward: Any  # TrunkRuntime.start_backward

    def forget(self, client_id: str, activation_id: str) -> None:
        """Drop a saved forward whose reply could not be delivered (the client resends it)."""
        with self._lock:
            if self.store.find(activation_id) is not None:
                self.store.get(activation_id, client_id)
                self.store.pop(activation_id)

    # -- maintenance -------------------------------------------------------------
    def sweep(self) -> int:
        """Evict expired saved forwards; returns how many were evicted.

        A client that lost its last saved forward this way can no longer
        contribute to the open step: it leaves the step group (its next
        training forward brings it back).
        """
        with self._lock:
            evicted = self.store.sweep()
            gone = self.store.take_evicted_clients()
        for client_id in gone:
            self.aggregator.leave(client_id)
        return evicted

    def state_dict(self) -> dict[str, Any]:
        """Trunk weights, optimizer state and version, for checkpoints."""
        with self._lock:
            return {"trunk": self.trunk.state_dict(), "version": self._version,
                    "optimizer": None if self.optimizer is None else self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Restore what :meth:`state_dict` returned (``strict=False``: trunk tensors may be a subset, e.g.
        LoRA adapters over a base that was read from the pretrained checkpoint)."""
        with self._lock:
            self.trunk.load_state_dict(state["trunk"], strict=strict)
            if self.optimizer is not None and state.get("optimizer") is not None:
                self.optimizer.load_state_dict(state["optimizer"])
            self._version = int(state["version"])

    # -- driving ---------------------------------------------------------------------
    def deadline(self) -> float | None:
        """When :meth:`poll` next has work: a member falls silent (monotonic seconds), or None."""
        return self.aggregator.deadline()

    def poll(self) -> None:
        """Drop silent members, closing a bucket they held up (their saved forwards wait for their TTL:
        a slow client's late backward still gets its input gradient), and run the backward of batches
        whose missing members were dropped."""
        self.aggregator.poll()
        self._batches.poll()

    # -- without a scheduler ------------------------------------------------------------
    def backward(self, client_id: str, activation_id: str, grad: torch.Tensor, *,
                 retry: bool = False, step: StepPart | None = None) -> BackwardResult:
        """Blocking :meth:`start_backward`: waits for the input gradient and the step's outcome (firing
        timeouts itself)."""
        pending = self.start_backward(client_id, activation_id, grad, retry=retry, step=step)
        grad_in = self.wait(pending.grad_in)
        return BackwardResult(grad_in, self.wait(pending.result))

    def wait(self, result: Future[T]) -> T:
        """Wait for a future of this runtime, polling at each deadline (for callers without a scheduler)."""
        while True:
            deadline = self.deadline()
            remaining = self.aggregator.timeout if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                return result.result(timeout=remaining + 0.001)
            except TimeoutError:
                self.poll()

    def refused(self, client_id: str) -> None:
        """A training request of this client was refused: the step stops waiting for it.

        It leaves the step group (its saved forwards wait for their TTL); a
        later gradient or training forward brings it back.
        """
        self.aggregator.leave(client_id)
