"""Where the trunk runtime's inputs and outputs live: moving inputs to its device, checking what arrived there,
handing outputs back, and the compute context (mixed precision, attention kernels).

A mixin of :class:`splitfed.trunk.compute.runtime.TrunkRuntime`, kept apart from the forward and backward paths.

Attention kernels: on CUDA the runtime prefers FlashAttention and memory-efficient attention over cuDNN's.
cuDNN's kernel builds an execution plan for every new input shape (about 100 ms each on an H100, measured with
``python -m bench.trunk_runtime --vary``), and a server's batches change shape with every batching window and
every decode step; the other two kernels take any shape at no extra cost. ``sdpa_backends`` overrides the
choice. PyTorch keeps this choice process-wide: it holds for every thread while the trunk computes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from splitfed.errors import TensorValueError
from splitfed.split.base import CutState
from splitfed.codec.transfer import Staging
from splitfed.trunk.device.transfers import Arrival, DeviceIO, ReplySink, send
from splitfed.trunk.device.early import nonfinite
from splitfed.trunk.compute.requests import ForwardRequest

try:  # torch >= 2.3
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # pragma: no cover - older torch: the default kernels
    SDPBackend = None  # type: ignore[assignment,misc]
    sdpa_kernel = None  # type: ignore[assignment]


#: Outputs of at least this many bytes leave a GPU runtime on the device (see :meth:`RuntimePlacement.handed`).
ASYNC_HAND_BYTES = 1 << 16


def default_sdpa_backends(device: torch.device) -> tuple[Any, ...] | None:
    """The attention kernels a trunk on ``device`` uses (None: PyTorch's own choice)."""
    if device.type != "cuda" or SDPBackend is None:
        return None
    return (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


class RuntimePlacement:
    """Inputs in, outputs out and the compute context of a trunk runtime."""

    trunk: nn.Module
    device: torch.device
    dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    sdpa_backends: Sequence[Any] | None
    host_outputs: bool
    _device_out: bool
    _staging: Staging | None
    io: DeviceIO | None
    #: Whether a server brings the tensors of a window's forwards and of a batch's gradients to the device as they
    #: come, a chunk at a time (:mod:`splitfed.trunk.device.early`); off unless set.
    bring_early: bool

    def _stepwise(self) -> contextlib.AbstractContextManager[Any]:
        """The context for calls whose shapes change every time (decoding over a growing KV cache): compiled
        blocks run eagerly there (:func:`~splitfed.trunk.compute.compiled.eager`)."""
        if getattr(self, "compiled", False):
            from splitfed.trunk.compute.compiled import eager

            return eager()
        return contextlib.nullcontext()

    def _autocast(self, cache: bool = True) -> contextlib.AbstractContextManager[Any]:
        """The context trunk compute runs in: mixed precision (``autocast_dtype``) and the attention kernels.

        ``cache=False``: autocast keeps no casts of the weights between operations (what a CUDA graph's capture
        needs: the casts then run inside the graph, from the weights as they are at each replay)."""
        stack = contextlib.ExitStack()
        if self.autocast_dtype is not None:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast_dtype, cache_enabled=cache))
        if self.sdpa_backends and sdpa_kernel is not None:
            stack.enter_context(sdpa_kernel(list(self.sdpa_backends)))
        return stack

    def handed(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as handed to the caller: in host memory when ``host_outputs``, else as it is.

        On a GPU a small ``t`` is copied here, on the thread that computed it, into a pinned buffer (a copy to
        pageable memory runs several times slower); one of :data:`ASYNC_HAND_BYTES` or more stays on the device,
        and the caller copies it by the copy engine (:meth:`~splitfed.trunk.device.transfers.DeviceIO.to_host`) so that
        this thread never waits for it.
        """
        if not self.host_outputs or self._device_out or t.device.type == "cpu":
            return t
        if self.io is None or not self.io.cuda:
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            out.copy_(t)
            return out
        if t.numel() * t.element_size() >= ASYNC_HAND_BYTES:
            return t
        departure = self.io.to_host(t)
        departure.event.synchronize()
        return departure.host

    def deliver(self, items: Sequence[tuple[torch.Tensor, ReplySink | None]]) -> list[Any]:
        """Outputs as handed to their callers: those with a :class:`~splitfed.trunk.device.transfers.ReplySink` sent there
        by the copy engine (a :class:`~splitfed.trunk.device.transfers.Departure` each; one pair of events for them all),
        the others as :meth:`handed` gives them."""
        out: list[Any] = [None] * len(items)
        sent = [i for i, (t, sink) in enumerate(items) if sink is not None and t.is_cuda and self.io is not None
                and self.io.cuda and self.host_outputs and not self._device_out]
        if sent:
            assert self.io is not None
            for i, departure in zip(sent, send(self.io, [(items[i][0], items[i][1]) for i in sent])):
                out[i] = departure
        for i, (t, _) in enumerate(items):
            if out[i] is None:
                out[i] = self.handed(t)
        return out

    def check_input(self, state: CutState) -> None:
        """Refuse a state the trunk cannot take (not floating, wrong rank or width) with :class:`TensorValueError`."""
        if not state.hidden.is_floating_point():
            raise TensorValueError(f"hidden must be a floating tensor, got {state.hidden.dtype}")
        check = getattr(self.trunk, "check_input", None)
        if check is not None:
            try:
                check(state)
            except ValueError as exc:
                raise TensorValueError(str(exc)) from None

    def bring(self, arrivals: Sequence[Arrival]) -> None:
        """Bring the tensors a request left in host memory (:class:`~splitfed.trunk.device.transfers.Arrival`) to the
        device, each into its :attr:`~splitfed.trunk.device.transfers.Arrival.tensor`; refuse them with
        :class:`TensorValueError` when one holds NaN or Inf. Nothing else changes on a refusal."""
        if not arrivals:
            return
        assert self.io is not None, "arrivals come only to a runtime with a DeviceIO"
        for a, ok in zip(arrivals, self.io.bring(arrivals)):
            if not ok:
                raise nonfinite(a.name)

    def bring_requests(self, requests: list[ForwardRequest]) -> tuple[list[ForwardRequest], dict[int, str]]:
        """Bring every request's tensors still in host memory (one call for all of them): the requests with their
        states as brought, and those holding NaN or Inf (index -> tensor name), left as they were."""
        arrivals = [(i, a) for i, r in enumerate(requests) for a in r.arrivals]
        if not arrivals:
            return requests, {}
        assert self.io is not None, "arrivals come only to a runtime with a DeviceIO"
        bad: dict[int, str] = {}
        for (i, a), ok in zip(arrivals, self.io.bring([a for _, a in arrivals])):
            if not ok:
                bad.setdefault(i, a.name)
        return [replace(r, state=self.brought(r.state, r.arrivals), arrivals=()) if r.arrivals and i not in bad
                else r for i, r in enumerate(requests)], bad

    @staticmethod
    def brought(state: CutState, arrivals: Sequence[Arrival]) -> CutState:
        """``state`` with its hidden tensor as brought (see :meth:`bring`)."""
        for a in arrivals:
            if a.name == "hidden":
                assert a.tensor is not None
                state = state.with_hidden(a.tensor)
        return state

    def _prepare(self, state: CutState, train: bool) -> tuple[CutState, torch.Tensor | None]:
        """Move the input to the trunk's device and dtype.

        Returns the state the trunk runs on and, when training, the leaf whose
        gradient goes back to the client. When training, the trunk gets a copy
        (a non-leaf) so that in-place first layers work as in the unsplit model.
        """
        self.check_input(state)
        if state.hidden.is_meta:
            raise RuntimeError("internal error: a tensor still in host memory reached the trunk; bring it first")
        hidden = state.hidden.to(self.device, self.dtype) if self._staging is None else \
            self._staging.to_device(state.hidden, self.dtype)
        leaf = None
        if train:
            leaf = hidden.detach().requires_grad_(True)
            hidden = leaf.clone()
        move = (lambda t: None if t is None else t.to(self.device))
        return CutState(hidden, move(state.attention_mask), move(state.position_ids), state.blocks), leaf
