"""SplitFed V1 on the trunk (``trunk-mode = "per-client"``): one trunk copy per client for the round.

Thapa et al. (AAAI 2022): the server keeps a copy of the trunk for every client,
trains each copy with that client's gradients only, and at the end of the round
averages the copies (FedAvg) into the next round's trunk.

Here a copy holds the trunk's *trainable* parameters only (the LoRA adapters of
a LoRA trunk; the frozen base is shared), and its own optimizer state. It is made
from the round's global trunk at the client's first training forward of the
round (the global trunk does not change within a round in this mode, so that is
the round's starting point), and the runtime runs that client's forwards on it
with ``torch.func.functional_call`` (:meth:`PerClientAggregator.weights_for`).
Each gradient steps the client's copy at once: a copy trained alone on a
client's gradients is exactly that client's part of an unsplit model trained on
its data alone.

At the end of the round the server side takes the copies
(:meth:`PerClientAggregator.end_round`, which frees them) and merges them with a
Flower strategy, weighted by the examples each copy trained on (see
``strategies/trunk_copies.py``); the merged weights become the global trunk.

Memory is bounded: copies together (weights and optimizer state) may hold at
most ``max_bytes``; a client whose copy would go over it is refused with
:class:`~splitfed.errors.ResourceExhaustedError` (RESOURCE_EXHAUSTED).

Concurrency: called by the trunk runtime on its device thread (forwards and
gradients) and by the server side at round boundaries; one lock guards the copies.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from splitfed.errors import ConfigError, PermissionDeniedError, ResourceExhaustedError
from splitfed.trunk.aggregation.modes import CopyOptimizer, TrunkAggregator
from splitfed.trunk.aggregation.contributions import Contribution, Outcome, Result
from splitfed.trunk.compute.requests import resolved

log = logging.getLogger(__name__)


@dataclass
class TrunkCopy:
    """One client's copy of the trunk's trainable parameters for the round, and its optimizer."""

    client_id: str
    params: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    num_examples: int = 0
    steps: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the copy's weights and of its optimizer state."""
        total = sum(p.numel() * p.element_size() for p in self.params)
        for state in self.optimizer.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
        return total


@dataclass(frozen=True)
class TrainedCopy:
    """What a round's copy hands to the merge: the client, its weights by name, the examples it trained on."""

    client_id: str
    state: dict[str, torch.Tensor]
    num_examples: int
    steps: int


class PerClientAggregator(TrunkAggregator):
    """Per-client trunk copies (SplitFed V1); see the module docstring.

    Args:
        optimizer: builds a copy's optimizer over its parameters (default: SGD, lr 0.01).
        proximal_mu: FedProx on the trunk: each copy's gradient gets ``mu * (w - w_global)`` added.
        max_bytes: what all copies together may hold (weights and optimizer state).
        timeout: seconds without a sign of life after which a member leaves the step group.
        clock: monotonic seconds (tests inject one).
    """

    mode = "per-client"

    def __init__(self, optimizer: CopyOptimizer | None = None, *, proximal_mu: float = 0.0,
                 max_bytes: int = 8 << 30, timeout: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(timeout=timeout, clock=clock)
        if proximal_mu < 0 or max_bytes < 1:
            raise ConfigError(f"proximal_mu must be >= 0 and max_bytes >= 1, got {proximal_mu} and {max_bytes}")
        self.make_optimizer: CopyOptimizer = optimizer or (lambda ps: torch.optim.SGD(ps, lr=0.01))
        self.proximal_mu = proximal_mu
        self.max_bytes = max_bytes
        self._names: list[str] = []
        self._global: list[torch.Tensor] = []
        self._copies: dict[str, TrunkCopy] = {}
        self._clients: frozenset[str] | None = None
        self.server_round = 0
        self.stats.update({"copies-made": 0, "copies-freed": 0})

    # -- wiring --------------------------------------------------------------------------
    def track_trunk(self, names: Sequence[str], params: Sequence[torch.Tensor]) -> None:
        self._names, self._global = list(names), list(params)

    @property
    def names(self) -> list[str]:
        """Names of the trunk's trainable parameters (the keys of a copy's state)."""
        return list(self._names)

    def global_state(self) -> dict[str, torch.Tensor]:
        """The global trunk's trainable weights by name (detached copies)."""
        with self._lock:
            return {n: p.detach().clone() for n, p in zip(self._names, self._global)}

    # -- the round --------------------------------------------------------------------------
    def begin_round(self, server_round: int, clients: Sequence[str]) -> None:
        """Only ``clients`` may train copies this round; copies left from an unmerged round are freed."""
        with self._lock:
            if self._copies:
                log.warning("per-client: freeing %d trunk copies of round %d that were never merged",
                            len(self._copies), self.server_round)
                self._free()
            self._clients = frozenset(clients)
            self.server_round = server_round

    def weights_for(self, client_id: str) -> list[torch.Tensor]:
        """The client's copy (made now from the global trunk if it has none this round)."""
        with self._lock:
            copy = self._copies.get(client_id)
            if copy is not None:
                return copy.params
            if self._clients is not None and client_id not in self._clients:
                raise PermissionDeniedError(f"client {client_id} is not a participant of round {self.server_round}; "
                                            "wait for the next round's train message")
            if not self._global:
                raise ConfigError("per-client mode needs a trunk with trainable parameters")
            params = [p.detach().clone().requires_grad_(True) for p in self._global]
            copy = TrunkCopy(client_id, params, self.make_optimizer(params))
            held = self.bytes_held
            if held + copy.nbytes > self.max_bytes:
                raise ResourceExhaustedError(
                    f"a trunk copy for {client_id} needs {copy.nbytes} bytes and the copies hold {held} of "
                    f"{self.max_bytes}; sample fewer clients per round or use LoRA on the trunk")
            self._copies[client_id] = copy
            self.stats["copies-made"] += 1
            log.debug("per-client: made a trunk copy for %s (%d bytes)", client_id, copy.nbytes)
            return copy.params

    @property
    def bytes_held(self) -> int:
        """Bytes all copies hold now (weights and optimizer state)."""
        with self._lock:
            return sum(c.nbytes for c in self._copies.values())

    @property
    def copies(self) -> int:
        """Copies alive now."""
        with self._lock:
            return len(self._copies)

    def trained(self) -> list[TrainedCopy]:
        """The copies that took a step this round, by client id (their weights detached, not cloned)."""
        with self._lock:
            return [TrainedCopy(c.client_id, {n: p.detach() for n, p in zip(self._names, c.params)},
                                c.num_examples, c.steps)
                    for c in sorted(self._copies.values(), key=lambda c: c.client_id) if c.steps]

    def end_round(self) -> list[TrainedCopy]:
        """:meth:`trained`, and free every copy of the round (their optimizer state with them)."""
        with self._lock:
            out = self.trained()
            self._free()
            return out

    def _free(self) -> None:
        self.stats["copies-freed"] += len(self._copies)
        for copy in self._copies.values():
            copy.optimizer.state.clear()
        self._copies.clear()

    # -- gradients ------------------------------------------------------------------------------
    def ready(self, bucket_clients: set[str], members: set[str]) -> bool:
        return True

    def offer(self, c: Contribution) -> Future[Result]:
        """Step the client's copy with its gradient at once."""
        with self._lock:
            for client in c.clients:
                self._members[client] = self.clock()
            version = self.version
            if c.grads is None:
                self.stats[Outcome.REJECTED_GUARD.value] += 1
                return resolved(Result(Outcome.REJECTED_GUARD, version, 0, 0.0))
            copy = self._copies.get(c.client_id)
            if copy is None:  # its round was merged while the gradient was on its way
                self.stats[Outcome.REJECTED_STALE.value] += 1
                log.warning("per-client: a gradient of %s came after its round's copies were merged", c.client_id)
                return resolved(Result(Outcome.REJECTED_STALE, version, 1, 0.0))
            try:
                for p, g, w in zip(copy.params, c.grads, self._global):
                    if g is None:
                        continue
                    g = g.to(p.dtype)
                    p.grad = g + self.proximal_mu * (p.detach() - w.detach()) if self.proximal_mu else g
                copy.optimizer.step()
            finally:
                copy.optimizer.zero_grad(set_to_none=True)
            copy.num_examples += c.num_examples
            copy.steps += 1
            self.stats["steps"] += 1
            self.stats[Outcome.APPLIED.value] += 1
            return resolved(Result(Outcome.APPLIED, version, 0, 1.0))

    def describe(self) -> str:
        return (f"per-client (SplitFed V1: a trunk copy per client, merged each round; proximal-mu="
                f"{self.proximal_mu}, copies up to {self.max_bytes} bytes, timeout={self.timeout}s)")
