"""The trunk as a module on the client: :class:`RemoteTrunk`, a plain ``nn.Module`` over a
:class:`~splitfed.channel.client.trunk.TrunkClient`.

Its forward sends the activation to the trunk server and its autograd backward
sends the gradient and returns the gradient for the bottom part, so client
training code stays ``loss.backward(); optimizer.step()``.
"""

from __future__ import annotations

import uuid
from typing import Any

import torch
from torch import nn

from splitfed.channel.client.trunk import PART_OUTCOME, BackwardReply, TrunkClient
from splitfed.errors import SplitError
from splitfed.split.base import CutState


def _to(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``t`` (host memory of its own) on ``device`` in ``dtype``: copied to a GPU first, cast there."""
    if device.type == "cpu":
        return t if t.dtype == dtype else t.to(dtype)
    return t.to(device, non_blocking=t.is_pinned()).to(dtype)


class _RemoteTrunkFunction(torch.autograd.Function):
    """Forward: send the activation. Backward: send its gradient, return the input's gradient.

    The output is in host memory (on a GPU client, :class:`_ToDevice` brings it to the device), so that autograd
    runs this node's backward on the thread that called ``backward()``, not on a GPU's autograd worker thread:
    a trunk served from the same process needs that worker for its own backward. The input may be on the
    device: it is copied from there straight to where it travels (a shared-memory region, or the socket).
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, anchor: torch.Tensor, remote: RemoteTrunk,
                state: CutState) -> torch.Tensor:
        activation_id = uuid.uuid4().hex
        out, version = remote.client.forward(state.with_hidden(hidden.detach()), activation_id=activation_id,
                                             train=True, num_examples=remote._num_examples(state), owned=True)
        ctx.remote, ctx.activation_id = remote, activation_id
        ctx.in_dtype, ctx.device, ctx.in_numel = hidden.dtype, hidden.device, hidden.numel()
        remote.last_version = version
        return out if hidden.device.type != "cpu" else _to(out, hidden.device, hidden.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        reply = ctx.remote.client.backward(ctx.activation_id, grad_out.contiguous(), input_numel=ctx.in_numel,
                                           owned=True)
        ctx.remote._record(reply)
        return _to(reply.grad, ctx.device, ctx.in_dtype), None, None, None


class _ToDevice(torch.autograd.Function):
    """Host -> device for the trunk's output; the backward brings the gradient back to (pinned) host memory in
    the dtype the output arrived in (cast on the device: fewer bytes to copy)."""

    @staticmethod
    def forward(ctx: Any, host: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        ctx.host_dtype = host.dtype
        return _to(host, device, dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        g = grad.detach().to(ctx.host_dtype)
        out = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
        out.copy_(g)
        return out, None, None


class RemoteTrunk(nn.Module):
    """The trunk as a module on the client: ``CutState -> CutState`` through the split channel.

    In training mode with gradients enabled, forwards are kept by the server
    for their backward, which autograd sends when ``loss.backward()`` runs. In
    eval mode or under ``torch.no_grad()``, forwards are evaluation-only.

    Args:
        client: a :class:`TrunkClient`, or an address (then ``client_kwargs`` build one; ``model="name"``
            picks a model on a server that holds several).
    """

    def __init__(self, client: TrunkClient | str, **client_kwargs: Any) -> None:
        super().__init__()
        self.client = client if isinstance(client, TrunkClient) else TrunkClient(client, **client_kwargs)
        self.num_examples: int | None = None
        #: On a GPU, run training steps whose cut CUDA events order through the pipeline's autograd nodes (the
        #: output stays on the device, no host waits); False keeps the plain one-node graph (DP-SGD does).
        self.gpu_pipeline = True
        self.last_version = 0
        self.outcomes: dict[str, int] = {}

    def _num_examples(self, state: CutState) -> int:
        return self.num_examples if self.num_examples is not None else int(state.hidden.shape[0])

    def _record(self, reply: BackwardReply) -> None:
        if reply.outcome != PART_OUTCOME:  # a micro-batch: its step's outcome comes with the last part
            self.outcomes[reply.outcome] = self.outcomes.get(reply.outcome, 0) + 1
        self.last_version = reply.trunk_version

    def pipeline(self, parts: int, *, train: bool) -> Any:
        """``parts`` micro-batches of one step in flight at once (a
        :class:`~splitfed.channel.client.pipeline.RemotePipeline`; :class:`~splitfed.split.SplitModel` drives it)."""
        from splitfed.channel.client.pipeline import RemotePipeline

        return RemotePipeline(self, parts, train=train)

    def forward(self, state: CutState) -> CutState:
        """Run the remote trunk on ``state``."""
        if self.training and torch.is_grad_enabled():
            # The anchor makes the output require grad even when the bottom is frozen,
            # so the trunk and top still train.
            hidden = state.hidden
            wire = self.client.wire_compression
            if self.gpu_pipeline and hidden.is_cuda and (wire.activations.active or wire.gradients.active
                                                         or self.client.shared.gpu_ordered(hidden)):
                # The cut's tensors are compressed and rebuilt on the GPU, or client and trunk share a GPU's host
                # (the cut's copies are ordered by CUDA events): the pipeline's autograd nodes keep the output on
                # the device without a thread waiting on it.
                pipe = self.pipeline(1, train=True)
                pipe.send(0, state)
                return pipe.receive(0)
            anchor = torch.empty(0, requires_grad=True)
            out = _RemoteTrunkFunction.apply(hidden, anchor, self, state)
            return state.with_hidden(out if hidden.device.type == "cpu" else
                                     _ToDevice.apply(out, hidden.device, hidden.dtype))
        out, version = self.client.forward(state.with_hidden(state.hidden.detach()), train=False)
        self.last_version = version
        return state.with_hidden(out.to(device=state.hidden.device, dtype=state.hidden.dtype))

    def use_cut(self, cut: tuple[int, int]) -> None:
        """Send ``cut``, the cut of the client's parts, with every Forward (:class:`~splitfed.split.SplitModel`
        calls this), so a trunk server cut elsewhere refuses the first call naming both cuts instead of failing
        inside the model or, for same-shaped cuts, computing the wrong blocks."""
        cut = (int(cut[0]), int(cut[1]))
        if self.client.cut not in ((0, 0), cut):
            raise SplitError(f"this RemoteTrunk was given cut={self.client.cut}, but the client's parts are cut at "
                             f"{cut}; build both from the same cuts")
        self.client.cut = cut

    def close(self) -> None:
        """Leave the trunk's step group (when this client trained) and close the connection; ``with
        RemoteTrunk(...) as trunk:`` does it on leaving the block."""
        self.client.close()

    def __enter__(self) -> RemoteTrunk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
