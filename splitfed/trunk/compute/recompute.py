"""What saving and recomputing a trunk forward needs: saved-byte accounting, RNG state, device errors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.func import functional_call

from splitfed.errors import TrunkBusyError
from splitfed.split.base import CutState


class SavedBytes:
    """Counts the bytes autograd saves for backward, leaving out the parameters' own storage.

    The pack hook returns a detached alias: returning the tensor itself would make
    every saved *output* hold its own graph node, a reference cycle through C++
    that Python's garbage collector cannot break, so a forward dropped without its
    backward (evicted, rebased) would leak its activations.
    """

    def __init__(self, param_ptrs: set[int]) -> None:
        self.param_ptrs = param_ptrs
        self.seen: set[int] = set()
        self.nbytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.param_ptrs and ptr not in self.seen:
            self.seen.add(ptr)
            self.nbytes += storage.nbytes()
        return t.detach()

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


@contextlib.contextmanager
def busy_on_oom(what: str) -> Iterator[None]:
    """Turn a device out-of-memory error into :class:`TrunkBusyError` (retrying later can succeed)."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        raise TrunkBusyError(f"the trunk ran out of device memory in a {what}; retry later or send smaller "
                             f"batches ({exc})") from None


def rng_devices(device: torch.device) -> list[int]:
    """The CUDA devices whose RNG ``torch.random.fork_rng`` must save for a trunk on ``device``."""
    return [device.index or 0] if device.type == "cuda" else []


def rng_state(device: torch.device) -> Any:
    """The RNG state a forward on ``device`` starts from (CPU, and CUDA when the trunk is there)."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return cpu, cuda


def set_rng_state(device: torch.device, state: Any) -> None:
    """Restore what :func:`rng_state` returned, so a recomputed forward draws the same dropout masks."""
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def rerun(trunk: torch.nn.Module, names: Sequence[str], inputs: CutState, rng: Any,
          frozen: Sequence[torch.Tensor] | None, autocast: contextlib.AbstractContextManager[Any]) -> torch.Tensor:
    """A training forward again, with its graph: ``trunk`` on ``inputs`` with the RNG state it first ran with,
    on the ``frozen`` weights it saw (named ``names``), or on the live ones when None."""
    device = inputs.hidden.device
    with torch.random.fork_rng(devices=rng_devices(device)), autocast:
        set_rng_state(device, rng)
        state = inputs.with_hidden(inputs.hidden.clone())
        if frozen is None:
            return trunk(state).hidden
        return functional_call(trunk, dict(zip(names, frozen)), (state,)).hidden
