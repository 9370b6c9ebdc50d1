"""What callers hand the trunk runtime and what it hands back: queued forwards, pending backwards."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from splitfed.split.base import CutState
from splitfed.trunk.aggregation.contributions import Result


@dataclass(frozen=True)
class BackwardResult:
    """The gradient for the client's bottom part, and what happened to the trunk's gradient."""

    grad_in: torch.Tensor
    result: Result


@dataclass(frozen=True)
class PendingBackward:
    """A Backward taken: its input gradient (at once, or when its batch's backward ran) and the step's outcome."""

    grad_in: Future[torch.Tensor]
    result: Future[Result]


class Promise(Future):  # type: ignore[type-arg]
    """A future that no waiter can cancel.

    What the trunk hands out is shared (a batch's backward, a sync step's outcome) or already queued for the
    device thread: one waiter giving up (an asyncio call cancelled by its client, whose ``wrap_future``
    cancels what it wraps) must neither cancel it for the others nor make the thread that resolves it fail.
    A waiter that gives up only stops waiting.
    """

    def cancel(self) -> bool:
        return False


def resolved(value: Any) -> Future[Any]:
    """A future that already holds ``value``."""
    future: Future[Any] = Promise()
    future.set_result(value)
    return future


#: Checks a Backward's reply before anything is consumed: called with the input's shape.
ReplyCheck = Callable[[tuple[int, ...]], None]


@dataclass(frozen=True)
class ForwardRequest:
    """One client's Forward, as the scheduler queues it."""

    client_id: str
    activation_id: str
    state: CutState
    train: bool
    num_examples: int = 1
    retry: bool = False
    #: Hand the output back on the trunk's device (the reply is copied from there, ordered by a CUDA event).
    device_out: bool = False
    #: The state's tensors still in host memory (:class:`~splitfed.trunk.device.transfers.Arrival`): the runtime brings them.
    arrivals: tuple[Any, ...] = ()
    #: Where the output goes (:class:`~splitfed.trunk.device.transfers.ReplySink`; None: handed back as it is).
    reply: Any = None

    @property
    def tokens(self) -> int:
        """Positions this forward computes (batch x length; batch for non-sequence inputs)."""
        h = self.state.hidden
        return int(h.shape[0] * h.shape[1]) if h.dim() >= 3 else int(h.shape[0]) if h.dim() else 1
