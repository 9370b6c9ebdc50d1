"""Micro-batches of one client step, gathered into one trunk contribution.

A client that pipelines its step (``micro_batches = k``) sends k forwards and
k backwards; each Backward names its step (``step_id``) and the number of parts
(``step_parts``). The trunk computes each part's input gradient at once and
hands it back, and sums the parts' trunk gradients here. When the k-th part
arrives, the sum goes to the aggregator as *one* contribution of the client
(its examples: the sum of the parts'; the version it saw: the oldest of the
parts'), so sync, quorum and async steps, staleness and the step count are
exactly those of the unpipelined step. The parts that did not complete the
step are answered with :attr:`~splitfed.trunk.aggregation.contributions.Outcome.PART`; the
part that completed it waits for the step's outcome like any Backward.

Each client has at most one open step: a part of a new step drops the
incomplete one (a client whose step failed half-way), and so does leaving the
step group. An open step holds its parts' trunk gradients until the last
arrives (at most ``step_parts`` times the trunk's gradient, for one step per
client). Pure logic, thread-safe; the runtime calls it outside its lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from splitfed.errors import ActivationStateError, CodecError
from splitfed.trunk.aggregation.contributions import Grads, Outcome, Result
from splitfed.trunk.compute.requests import resolved

log = logging.getLogger(__name__)

#: Most micro-batches one client step may have.
MAX_STEP_PARTS = 4096
#: Longest step id accepted.
MAX_STEP_ID = 128

#: ``submit(client_id, version_seen, grads, num_examples)``: the runtime's hand-over to its aggregator.
Submit = Callable[[str, int, Grads, int], "Future[Result]"]


@dataclass(frozen=True)
class StepPart:
    """Which client step a Backward belongs to: its id and how many parts it has."""

    step_id: str
    parts: int

    @staticmethod
    def of(step_id: str, parts: int) -> StepPart | None:
        """The step of a request's ``step_id``/``step_parts`` (None: a backward alone); refuses bad values with
        :class:`~splitfed.errors.CodecError`."""
        if parts < 0 or parts > MAX_STEP_PARTS:
            raise CodecError(f"step_parts must be between 0 and {MAX_STEP_PARTS}, got {parts}")
        if len(step_id) > MAX_STEP_ID:
            raise CodecError(f"step_id is longer than {MAX_STEP_ID} characters")
        if parts <= 1:
            return None
        if not step_id:
            raise CodecError(f"step_parts is {parts} but step_id is empty; give the micro-batches of one step a "
                             "common step id")
        return StepPart(step_id, parts)


@dataclass
class _Open:
    step_id: str
    parts: int
    version: int = 0
    num_examples: int = 0
    grads: dict[str, Grads] = field(default_factory=dict)  # by activation id

    @property
    def received(self) -> int:
        return len(self.grads)

    def total(self) -> Grads:
        """The parts' gradients summed last part first (the order one backward over the concatenated micro-batches
        accumulates them), by activation id: the sum does not depend on arrival order."""
        out: Grads = []
        for key in sorted(self.grads, reverse=True):
            grads = self.grads[key]
            if not out:
                out = list(grads)
                continue
            for i, g in enumerate(grads):
                if g is not None:
                    out[i] = g if out[i] is None else out[i].add_(g)  # type: ignore[union-attr]
        return out


class MicroSteps:
    """Open client steps and their summed trunk gradients."""

    def __init__(self) -> None:
        self._open: dict[str, _Open] = {}
        self._lock = threading.Lock()
        self.stats: dict[str, int] = {"parts": 0, "steps": 0, "dropped": 0}

    def check(self, client_id: str, part: StepPart, *, batched: bool = False) -> None:
        """Refuse a part whose count differs from its open step's, or whose forward ran in a cross-client
        batch (its gradient is summed with other clients'), before anything is consumed."""
        if batched:
            raise ActivationStateError(
                "this forward ran in a cross-client batch, whose backward is one contribution of all its clients: "
                "it cannot be a micro-batch of a step; set trunk-batch-window-ms = 0 or micro-batches = 1")
        with self._lock:
            step = self._open.get(client_id)
        if step is not None and step.step_id == part.step_id and step.parts != part.parts:
            raise CodecError(f"step {part.step_id!r} was opened with {step.parts} parts, this backward says "
                             f"{part.parts}; every micro-batch of a step must send the same step_parts")

    def offer(self, client_id: str, part: StepPart, activation_id: str, version: int, grads: Grads,
              num_examples: int, submit: Submit) -> Future[Result]:
        """Add one part's trunk gradient; the step's contribution goes to ``submit`` with its last part.

        The parts are summed in descending order of their activation ids (a client
        that numbers them gets the same sum whatever order they arrive in).
        Returns the future of what the trunk did with the step (parts before
        the last: resolved at once with :attr:`Outcome.PART`).
        """
        with self._lock:
            step = self._open.get(client_id)
            if step is not None and step.step_id != part.step_id:
                self._drop(client_id, f"its step {part.step_id!r} began")
                step = None
            if step is None:
                step = self._open[client_id] = _Open(part.step_id, part.parts, version=version)
            step.version = min(step.version, version)
            step.num_examples += num_examples
            step.grads[activation_id] = grads
            self.stats["parts"] += 1
            if step.received < step.parts:
                return resolved(Result(Outcome.PART, version, 0, 1.0))
            del self._open[client_id]
            self.stats["steps"] += 1
        log.debug("client %s: step %s complete (%d parts, %d examples)", client_id, step.step_id, step.parts,
                  step.num_examples)
        return submit(client_id, step.version, step.total(), step.num_examples)

    def drop(self, client_id: str) -> None:
        """Forget a client's incomplete step (it left the step group)."""
        with self._lock:
            self._drop(client_id, "it left the step group")

    def _drop(self, client_id: str, why: str) -> None:
        step = self._open.pop(client_id, None)
        if step is not None:
            self.stats["dropped"] += 1
            log.warning("client %s: dropped step %s with %d of %d micro-batches because %s; those gradients are "
                        "not applied", client_id, step.step_id, step.received, step.parts, why)

    @property
    def pending(self) -> int:
        """Clients with an incomplete step."""
        with self._lock:
            return len(self._open)
