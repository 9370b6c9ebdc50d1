"""Bringing a step's tensors to the device while the rest of the step is still coming.

A sync step's clients send their Forwards, and later their Backwards, one after another over several
milliseconds; their tensors wait in host memory (a client's shared-memory region, a request's bytes) for the
device thread. Brought all at once when the window closes (the forwards) or when the batch's last gradient comes
(the backward), their copies to the GPU and their NaN/Inf check run while the GPU has nothing to do: at 32
clients of 16 rows, about 6 ms before the forward and 6 ms before the backward of each step.

With :attr:`~splitfed.trunk.device.placement.RuntimePlacement.bring_early` on (off by default: see docs/performance.md,
"Bringing a step's tensors as they come"), the device thread brings them in chunks as they come, a quarter of the
batch at a time: the forwards already in an open window (:meth:`~splitfed.trunk.scheduler.TrunkScheduler._take`),
and the gradients already in for a batch still waiting for others
(:meth:`~splitfed.trunk.compute.batched.Batcher.bring_gradients`). What is left when the window closes or the last
gradient comes is the last chunk. The outcome is the one of bringing them at the end: the same tensors, and a
tensor holding NaN or Inf refused with INVALID_ARGUMENT while the rest of its batch goes on.
"""

from __future__ import annotations

from typing import Any, Protocol

from splitfed.errors import TensorValueError
from splitfed.trunk.compute.requests import ForwardRequest

__all__ = ["bring_forwards", "chunk", "nonfinite", "unbrought"]


class WindowTask(Protocol):
    """A training forward waiting in an open window (the scheduler's task)."""

    forward: ForwardRequest | None
    error: BaseException | None


def chunk(expected: int) -> int:
    """How many tensors of a batch of ``expected`` members are brought early at once: a quarter, at least two
    (each bring waits for its copies and takes a turn of the interpreter lock)."""
    return max(2, -(-expected // 4))


def nonfinite(name: str) -> TensorValueError:
    """The refusal of a tensor that holds NaN or Inf."""
    return TensorValueError(f"tensor {name!r} holds NaN or Inf values; the sender must stop or lower its learning "
                            "rate before sending again")


def unbrought(tasks: list[Any]) -> list[Any]:
    """The window's forwards whose tensors are still in host memory."""
    return [t for t in tasks if t.error is None and t.forward is not None and t.forward.arrivals]


def bring_forwards(runtime: Any, tasks: list[WindowTask]) -> int:
    """Bring the tensors of ``tasks`` (forwards of an open window, still in host memory) to the device: each
    task's request then carries them; a request whose tensor holds NaN or Inf gets its refusal as ``error``.
    Returns how many were refused."""
    brought, bad = runtime.bring_requests([t.forward for t in tasks])
    for i, (task, request) in enumerate(zip(tasks, brought)):
        if i in bad:
            task.error = nonfinite(bad[i])
        else:
            task.forward = request
    return len(bad)
