"""Client gradients for the trunk and their outcomes: the data the aggregation modes decide on."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

Grads = list[torch.Tensor | None]


class Outcome(str, enum.Enum):
    """What happened to one client's gradient."""

    APPLIED = "applied"
    DOWNWEIGHTED = "downweighted"
    REJECTED_STALE = "rejected-stale"
    REJECTED_GUARD = "rejected-guard"
    NOT_TRAINED = "not-trained"
    #: A micro-batch of a client step still open: the step's outcome comes with the part that completes it.
    PART = "part"


@dataclass
class Contribution:
    """One client's trunk gradient for one forward.

    ``grads`` is aligned with the trunk's trainable parameters; ``None`` for an
    abstention (the gradient was refused by the guard but the client still
    counts as having answered this step).
    """

    client_id: str
    version_seen: int
    grads: Grads | None
    num_examples: int = 1
    weight: float = 1.0
    #: Every client this gradient stands for (a batched backward sums several); empty means ``client_id`` alone.
    members: tuple[str, ...] = ()

    @property
    def clients(self) -> tuple[str, ...]:
        """The clients that answered the step with this gradient."""
        return self.members or (self.client_id,)


@dataclass(frozen=True)
class Result:
    """What the aggregator reports back to the client: the outcome, the trunk version after the step,
    the staleness the gradient was applied (or rejected) at, and its weight."""

    outcome: Outcome
    version: int
    staleness: int
    weight: float = 1.0


def weighted_mean(contributions: Sequence[Contribution]) -> Grads | None:
    """Per parameter: sum of ``weight * num_examples * grad`` over the ``num_examples`` of the gradients that
    touched that parameter.

    With equal weights this is the gradient of the mean loss over the union of
    the clients' batches (each client sends the gradient of its batch-mean loss).
    A parameter some gradients leave out (``None``: a client with its own cut
    runs only some of the trunk's blocks) gets the mean over the clients that
    used it, so a block trained for some clients steps as far as one trained
    for all of them (see docs/heterogeneous_cuts.md).
    """
    live = [c for c in contributions if c.grads is not None]
    if not live:
        return None
    out: Grads = []
    for i in range(len(live[0].grads)):  # type: ignore[arg-type]
        used = [c for c in live if c.grads[i] is not None]  # type: ignore[index]
        total = float(sum(c.num_examples for c in used))
        acc: torch.Tensor | None = None
        for c in used:
            term = c.grads[i] * (c.weight * c.num_examples / total)  # type: ignore[index]
            acc = term if acc is None else acc.add_(term)
        out.append(acc)
    return out


@dataclass
class Offer:
    """A contribution waiting in a step's bucket, with the future its client awaits."""

    contribution: Contribution
    future: Future[Result]
    offered: float


@dataclass
class Bucket:
    """The contributions collected for the next trunk step."""

    opened: float | None = None
    items: list[Offer] = field(default_factory=list)

    @property
    def clients(self) -> set[str]:
        """Every client whose gradient is in the bucket (a batch counts all its members)."""
        return {client for i in self.items for client in i.contribution.clients}
