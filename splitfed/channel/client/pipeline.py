"""Micro-batches of one step in flight over the split channel: the remote trunk's :class:`CutPipeline`.

:class:`~splitfed.split.SplitModel` (``micro_batches = k``) hands each
micro-batch's bottom output to :meth:`RemotePipeline.send`, which starts its
device -> host copy (:mod:`splitfed.codec.transfer`) and its Forward on the client's
call threads and returns at once; :meth:`RemotePipeline.receive` waits for the
trunk's output. So the bottom of micro-batch i+1, the transfers and the trunk
on micro-batch i overlap, over one or several gRPC channels.

Autograd: each output is made by a :class:`_Cut` node whose backward only
*starts* that micro-batch's Backward (it does not wait), so the top's backward
of the next micro-batch runs while the gradient travels. All cut nodes feed
one :class:`_Drain` node (on the CPU, so it runs on the thread that called
``loss.backward()``, never on a GPU's autograd worker, which a trunk served in
the same process needs), whose backward takes the input gradients as they come
back and runs each micro-batch's bottom backward (a nested
``torch.autograd.backward``) while later micro-batches are still on the trunk.
The Backwards carry the step's id and part count: the trunk answers each part
at once and takes the k parts as one contribution; the part that completes the
step carries its outcome. Bottom gradients are accumulated into ``.grad``
(use ``loss.backward()``, not ``torch.autograd.grad``, with micro-batches).
"""

from __future__ import annotations

import logging
import uuid
from concurrent.futures import Future
from typing import Any

import torch

from splitfed.codec.tensors import torch_dtype
from splitfed.split.base import CutState
from splitfed.codec.transfer import HostCopy, Staging

log = logging.getLogger(__name__)


def staging_for(remote: Any, device: torch.device) -> Staging:
    """The :class:`Staging` a remote trunk keeps for ``device`` (its pinned buffers are reused step to step)."""
    stagings: dict[torch.device, Staging] = remote.__dict__.setdefault("_stagings", {})
    if device not in stagings:
        stagings[device] = Staging(device)
    return stagings[device]


class RemotePipeline:
    """One step's micro-batches in flight to a :class:`~splitfed.channel.client.remote.RemoteTrunk`.

    Args:
        remote: the remote trunk.
        parts: micro-batches in the step.
        train: training forwards (kept by the trunk for their backward) or evaluation ones.
    """

    def __init__(self, remote: Any, parts: int, *, train: bool) -> None:
        self.remote = remote
        self.client = remote.client
        self.parts = parts
        self.train = train
        self.step_id = uuid.uuid4().hex
        self._states: list[CutState | None] = [None] * parts
        self._inputs: list[torch.Tensor | None] = [None] * parts
        # Numbered ids: the trunk sums the parts' gradients in id order, so the sum does not depend on arrival.
        self._ids = [f"{self.step_id}.{i:04d}" for i in range(parts)]
        self._forwards: list[Future[Any] | None] = [None] * parts
        self._backwards: list[tuple[int, Future[Any]]] = []
        self._gate = _Drain.apply(torch.zeros((), requires_grad=True), self) if train else None

    def _wire(self, compressed: bool) -> torch.dtype | None:
        """The dtype to cast floating tensors to before they leave the device (None: as they are)."""
        return None if compressed else torch_dtype(self.client.wire_dtype)

    def _examples(self, part: int, batch: int) -> int:
        total = self.remote.num_examples
        if total is None:
            return batch
        share, extra = divmod(int(total), self.parts)
        return share + (1 if part < extra else 0)

    def _gpu_ordered(self, tensor: torch.Tensor, compressed: bool) -> bool:
        """Whether ``tensor`` is handed to the client's call on its GPU, and the result comes back there: when it
        is ``compressed`` (compressed and rebuilt on the GPU: only the compressed parts cross to and from the
        host), or when it crosses the cut through a shared-memory region whose copies CUDA events order."""
        return tensor.is_cuda and (compressed or self.client.shared.gpu_ordered(tensor))

    def send(self, part: int, state: CutState) -> None:
        """Start micro-batch ``part``'s copy to the host and its Forward; returns at once."""
        hidden = state.hidden
        self._states[part] = state
        self._inputs[part] = hidden if self.train and hidden.requires_grad else None
        n = self._examples(part, int(hidden.shape[0]))
        if self._gpu_ordered(hidden, self.client.wire_compression.activations.active):
            on_gpu = CutState(**{name: t.detach() for name, t in state.tensors().items()})
            self._forwards[part] = self.client.submit(
                self.client.forward, on_gpu, activation_id=self._ids[part], train=self.train, num_examples=n,
                on_device=True)
            return
        staging = staging_for(self.remote, hidden.device)
        wire = self._wire(self.client.wire_compression.activations.active)
        copies = {name: staging.to_host(t, wire if name == "hidden" else None) for name, t in state.tensors().items()}

        def call() -> tuple[torch.Tensor, int]:
            try:
                host = {name: c.wait() for name, c in copies.items()}
                return self.client.forward(CutState(**host), activation_id=self._ids[part], train=self.train,
                                           num_examples=n)
            finally:
                for c in copies.values():
                    c.release()
        self._forwards[part] = self.client.submit(call)

    def receive(self, part: int) -> CutState:
        """The trunk's output for micro-batch ``part``, on the bottom's device and dtype."""
        state = self._states[part]
        assert state is not None, "send() before receive()"
        if self.train:
            out = _Cut.apply(self._gate, self, part)
        else:
            hidden, version = self._result(part)
            self.remote.last_version = version
            out = staging_for(self.remote, state.hidden.device).to_device(hidden, state.hidden.dtype)
        return state.with_hidden(out)

    def _result(self, part: int) -> tuple[torch.Tensor, int]:
        future = self._forwards[part]
        assert future is not None
        return future.result()

    def start_backward(self, part: int, grad: torch.Tensor) -> None:
        """Start the Backward of micro-batch ``part`` (from the cut node's backward); returns at once."""
        state = self._states[part]
        assert state is not None
        numel = state.hidden.numel()
        step_id, parts = (self.step_id, self.parts) if self.parts > 1 else ("", 0)
        if self._gpu_ordered(grad, self.client.wire_compression.gradients.active):
            self._backwards.append((part, self.client.submit(
                self.client.backward, self._ids[part], grad.detach().contiguous(), input_numel=numel,
                step_id=step_id, step_parts=parts, feedback_key=f"grad.{part}", on_device=True)))
            return
        staging = staging_for(self.remote, grad.device)
        copy: HostCopy = staging.to_host(grad, self._wire(self.client.wire_compression.gradients.active))

        def call() -> Any:
            try:
                return self.client.backward(self._ids[part], copy.wait().contiguous(), input_numel=numel,
                                            step_id=step_id, step_parts=parts, feedback_key=f"grad.{part}")
            finally:
                copy.release()
        self._backwards.append((part, self.client.submit(call)))

    def drain(self) -> None:
        """Take every input gradient (in the order the Backwards were sent) and run that micro-batch's bottom
        backward; raises the first failure."""
        for part, future in self._backwards:
            reply = future.result()
            self.remote._record(reply)
            hidden = self._inputs[part]
            if hidden is not None:
                grad = staging_for(self.remote, hidden.device).to_device(reply.grad, hidden.dtype)
                torch.autograd.backward(hidden, grad)
        self._backwards.clear()


class _Drain(torch.autograd.Function):
    """The root every cut node feeds: its backward waits for the input gradients and runs the bottoms'
    backwards."""

    @staticmethod
    def forward(ctx: Any, seed: torch.Tensor, pipe: RemotePipeline) -> torch.Tensor:
        ctx.pipe = pipe
        return torch.zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[None, None]:
        ctx.pipe.drain()
        return None, None


class _Cut(torch.autograd.Function):
    """Forward: the trunk's output of one micro-batch. Backward: start its Backward, do not wait."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, pipe: RemotePipeline, part: int) -> torch.Tensor:
        ctx.pipe, ctx.part = pipe, part
        hidden, version = pipe._result(part)
        pipe.remote.last_version = version
        state = pipe._states[part]
        assert state is not None
        return staging_for(pipe.remote, state.hidden.device).to_device(hidden, state.hidden.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.pipe.start_backward(ctx.part, grad)
        return torch.zeros(()), None, None
