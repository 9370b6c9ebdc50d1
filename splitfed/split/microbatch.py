"""The pipelined split step: one client batch as k micro-batches, several in flight across the cut.

:class:`~splitfed.split.SplitModel` with ``micro_batches = k`` cuts its batch
(and mask, positions, token types, labels) into k micro-batches along the batch
dimension. The bottom runs on each in turn and hands it to the trunk's
pipeline without waiting (a remote trunk sends it at once, so the bottom of
micro-batch i+1, the trunk on micro-batch i and the transfers overlap); the top
then takes the trunk's outputs as they arrive. The logits are concatenated and
the loss is the task's loss over the *whole* batch, so its normalisation is
exactly the unpipelined one (the mean over every token of the batch, not a
mean of micro-batch means). In the backward the remote pipeline sends each
micro-batch's gradient as soon as the top's backward produced it and runs the
bottom's backward of each micro-batch as its input gradient comes back, while
later ones are still on the trunk (see :mod:`splitfed.channel.client.pipeline`); the
trunk takes the k backwards as one contribution of the client step
(:mod:`splitfed.trunk.aggregation.microsteps`).

The schedule is fill-drain within one ``loss.backward()`` (every forward,
then every backward), so a step holds the activations of one full batch, as the
unpipelined step does: pipelining never needs more memory than not pipelining.

A trunk that can pipeline has ``pipeline(parts, train=...)`` returning a
:class:`CutPipeline`; a local trunk (an ``nn.Module``) runs the micro-batches
one after another, with the same results.
"""

from __future__ import annotations

from typing import Protocol

import torch

from splitfed.errors import ConfigError
from splitfed.split.base import CutState

#: ``auto`` aims for micro-batches whose cut activation is at least this many bytes: smaller ones cost more in
#: per-call overhead (about a loopback round trip each) than their overlap saves.
AUTO_MIN_CUT_BYTES = 1 << 20
#: ``auto`` never picks more micro-batches than this.
AUTO_MAX = 4


class CutPipeline(Protocol):
    """Micro-batches of one step in flight across the cut."""

    def send(self, part: int, state: CutState) -> None:
        """Hand micro-batch ``part``'s bottom output to the trunk; returns without waiting for it."""

    def receive(self, part: int) -> CutState:
        """The trunk's output for micro-batch ``part`` (waits for it)."""


def resolve_micro_batches(value: str | int, batch_size: int, cut_bytes_per_example: int) -> int:
    """The number of micro-batches for ``value`` (an integer >= 1, or ``auto``).

    ``auto``: as many micro-batches (at most :data:`AUTO_MAX`, at most one per
    example) as keep each micro-batch's cut activation at least
    :data:`AUTO_MIN_CUT_BYTES` bytes: 1 for a small cut, where the per-call cost
    dominates, up to 4 for a large one (GPT-2 small at 16 x 512 tokens in bf16:
    12.6 MB, so 4).
    """
    if isinstance(value, str) and value != "auto":
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(f"micro-batches must be 'auto' or an integer >= 1, got {value!r}")
        value = int(value)
    if value == "auto":
        total = max(batch_size, 1) * max(cut_bytes_per_example, 0)
        return max(1, min(AUTO_MAX, batch_size, total // AUTO_MIN_CUT_BYTES))
    if int(value) < 1:
        raise ConfigError(f"micro-batches must be >= 1, got {value}")
    return int(value)


def split_batch(tensor: torch.Tensor | None, parts: int) -> list[torch.Tensor | None]:
    """``tensor`` cut into ``parts`` pieces along dim 0 (sizes differ by at most one; views, no copy)."""
    if tensor is None:
        return [None] * parts
    return list(torch.tensor_split(tensor, parts, dim=0))


def run_micro_batches(model: torch.nn.Module, inputs: torch.Tensor, parts: int,
                      extras: dict[str, torch.Tensor | None]) -> torch.Tensor:
    """Bottom, trunk and top of ``model`` (a SplitModel) over ``parts`` micro-batches; returns the logits of the
    whole batch (micro-batches concatenated in order)."""
    chunks = split_batch(inputs, parts)
    cut = {k: split_batch(v, parts) for k, v in extras.items()}
    # The bottom takes attention_mask and position_ids always (None included), other inputs only when given.
    kwargs = [{k: v[i] for k, v in cut.items() if v[i] is not None or k in ("attention_mask", "position_ids")}
              for i in range(parts)]
    make = getattr(model.trunk, "pipeline", None)
    pipe: CutPipeline | None = None
    if make is not None:
        pipe = make(parts, train=model.training and torch.is_grad_enabled())
    logits = []
    if pipe is None:
        for i in range(parts):
            logits.append(model.top(model.trunk(model.bottom(chunks[i], **kwargs[i]))))
    else:
        for i in range(parts):
            pipe.send(i, model.bottom(chunks[i], **kwargs[i]))
        for i in range(parts):
            logits.append(model.top(pipe.receive(i)))
    return torch.cat(logits, dim=0)
