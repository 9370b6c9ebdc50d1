"""The trunk runtime: forward and backward of the middle blocks for many clients, and the trunk's optimizer.

Pure torch: the gRPC servicer decodes requests, calls :meth:`TrunkRuntime.forward`
and :meth:`TrunkRuntime.backward`, and encodes what they return.

Concurrency: trunk computation and optimizer steps run under one lock, so a
step never changes weights under a running forward. Nothing here waits for
other clients: :meth:`TrunkRuntime.start_backward` returns the input gradient
at once with a future of the step's outcome, which a server awaits (see
:mod:`splitfed.trunk.scheduler`); :meth:`TrunkRuntime.backward` is the
blocking form for in-process callers. Whoever drives the runtime calls
:meth:`TrunkRuntime.poll` at :meth:`TrunkRuntime.deadline` so that silent
clients are dropped and saved forwards expire.

A forward whose backward has not arrived when the trunk steps (``async`` and
``quorum`` modes, or a client dropped in ``sync``) is *rebased*: its graph is
dropped and the weights it saw are kept (one frozen copy per step, shared, a
bounded number of them), so its backward recomputes the forward on those
weights (same RNG state) and the gradient is exactly that of the version the
client saw. In ``async`` mode with several clients a forward runs on a copy of its version's weights from the
start instead, and keeps its graph (:mod:`splitfed.trunk.compute.versions`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import torch
from torch import nn
from torch.func import functional_call

from splitfed.errors import (
    DuplicateActivationError,
    PermissionDeniedError,
    TensorValueError,
    TrunkStepError,
)
from splitfed.split.base import CutState
from splitfed.codec.transfer import Staging
from splitfed.trunk.aggregation.modes import (
    Contribution,
    Grads,
    Outcome,
    Result,
    SyncAggregator,
    TrunkAggregator,
)
from splitfed.trunk.compute.batched import Batcher
from splitfed.trunk.compute.compiled import compile_blocks, is_compiled, warm_up
from splitfed.trunk.device.transfers import Arrival, DeviceIO, ReplySink
from splitfed.trunk.aggregation.guard import GradientGuard
from splitfed.trunk.aggregation.microsteps import MicroSteps, StepPart
from splitfed.trunk.device.placement import RuntimePlacement, default_sdpa_backends
from splitfed.trunk.compute.recompute import (
    SavedBytes,
    busy_on_oom,
    rerun,
    rng_state,
)
from splitfed.trunk.compute.requests import (
    ForwardRequest,
    PendingBackward,
    ReplyCheck,
    resolved,
)
from splitfed.trunk.compute.store import DoneBackward, ForwardStore, SavedForward, StoreLimits
from splitfed.trunk.timeline import TIMELINE
from splitfed.trunk.compute.upkeep import RuntimeUpkeep
from splitfed.trunk.compute.versions import VersionCopies

log = logging.getLogger(__name__)

T = TypeVar("T")


class TrunkRuntime(RuntimePlacement, RuntimeUpkeep):
    """Hosts the trunk, its optimizer and the saved forwards of every client.

    Args:
        trunk: the middle part (a ``CutState -> CutState`` module).
        optimizer: the trunk's optimizer (over its trainable parameters), or None
            for a frozen trunk (forward and input gradients only).
        aggregator: decides when gradients update the trunk (default: sync).
        limits: TTL and byte budget of saved forwards.
        guard: refuses non-finite or exploding trunk gradients.
        device: where the trunk computes (default: where its parameters are).
        autocast_dtype: e.g. ``torch.bfloat16`` for mixed precision (fp32 weights).
        host_outputs: hand outputs and input gradients back in host memory, copied on the
            thread that computed them (a server: its event loop then never waits on the device).
        checkpointing: activation checkpointing: a training forward keeps only its input
            (and output), and its backward recomputes the forward (same weights, same RNG
            state), trading a second forward for the activations' memory.
        sdpa_backends: the attention kernels the trunk may use (default on CUDA: FlashAttention,
            memory-efficient, math; see :mod:`splitfed.trunk.device.placement`); None: PyTorch's choice.
        compile: compile the trunk's blocks with ``torch.compile`` (see :mod:`splitfed.trunk.compute.compiled`): far less
            host time per batch; results match the eager trunk to float rounding, not bit for bit. The graphs
            are compiled here, before any client comes (seconds to a minute).
    """

    def __init__(self, trunk: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 aggregator: TrunkAggregator | None = None, limits: StoreLimits = StoreLimits(),
                 guard: GradientGuard = GradientGuard(), device: torch.device | str | None = None,
                 autocast_dtype: torch.dtype | None = None, checkpointing: bool = False,
                 host_outputs: bool = False, sdpa_backends: Any = "auto", compile: bool = False) -> None:
        self.trunk = trunk
        self.optimizer = optimizer
        self.aggregator = aggregator or SyncAggregator()
        self.store = ForwardStore(limits)
        self._copies = VersionCopies(self.store)  # async forwards' weights, one copy per version
        self.guard = guard
        params = list(trunk.parameters())
        self.device = torch.device(device) if device is not None else (params[0].device if params else
                                                                         torch.device("cpu"))
        self.dtype = next((p.dtype for p in params if p.is_floating_point()), torch.float32)
        self.autocast_dtype = autocast_dtype
        self._names = [n for n, p in trunk.named_parameters() if p.requires_grad]
        self._trainable = [p for p in trunk.parameters() if p.requires_grad]
        self.checkpointing = checkpointing
        self.host_outputs = host_outputs
        self._device_out = False  # set while serving a request whose output stays on the device
        self._lock = threading.RLock()
        self._version = 0
        self._batches = Batcher(self)
        #: Whether the trunk's blocks are compiled (:mod:`splitfed.trunk.compute.compiled`).
        self.compiled = bool(compile and compile_blocks(trunk)) or is_compiled(trunk)
        self.micro = MicroSteps()  # micro-batches of one client step -> one contribution
        self._staging = Staging(self.device) if self.device.type == "cuda" else None  # pinned, side-stream h2d
        #: The cut's copies (see :mod:`splitfed.trunk.device.transfers`; on CUDA by the copy engine).
        self.io = DeviceIO(self.device)
        self.bring_early = False  # see splitfed.trunk.device.early
        self.sdpa_backends = default_sdpa_backends(self.device) if sdpa_backends == "auto" else sdpa_backends
        #: Runs a batch's backward once its last gradient is in (None: at once, on the thread that brought it);
        #: a server hands it to its device thread, so taking a batch member's gradient is light work.
        self.defer: Callable[[Callable[[], Any]], Any] | None = None
        self.aggregator.bind(self._apply_update, lambda: self._version)
        self.aggregator.track_trunk(self._names, self._trainable)
        self.stats: dict[str, int] = {"forwards": 0, "backwards": 0, "rebased": 0, "recomputed": 0}
        if compile and self.compiled:
            warm_up(trunk, self.device, self._autocast)

    # -- properties --------------------------------------------------------
    @property
    def version(self) -> int:
        """Optimizer steps the trunk has taken."""
        return self._version

    @property
    def trains(self) -> bool:
        """Whether the trunk has an optimizer and trainable parameters."""
        return self.optimizer is not None and bool(self._trainable)

    # -- group membership ----------------------------------------------------
    def join(self, client_id: str) -> int:
        """Add a client to the step group (sync/quorum count it)."""
        return self.aggregator.join(client_id)

    def leave(self, client_id: str) -> int:
        """Remove a client from the step group and free its saved forwards."""
        with self._lock:
            self.store.drop_client(client_id)
        self.micro.drop(client_id)
        return self.aggregator.leave(client_id)

    # -- forward -------------------------------------------------------------
    def forward(self, client_id: str, activation_id: str, state: CutState, *, train: bool, num_examples: int = 1,
                retry: bool = False, arrivals: Sequence[Arrival] = (), reply: ReplySink | None = None
                ) -> tuple[Any, int]:
        """Run the trunk on ``state``; keep what a backward needs when ``train``.

        Returns the output hidden state and the trunk version it was computed on.
        A retried request (``retry``) for a forward the server already holds is
        answered from the saved result; any other reuse of an activation id is
        refused. A training forward that succeeded puts its client in the step
        group (or marks it alive); a refused one does not. ``arrivals``: the state's tensors still in host memory
        (see :meth:`bring`); ``reply``: where the output goes (see :meth:`deliver`).
        """
        result = self._forward(client_id, activation_id, state, train, num_examples, retry, arrivals, reply)
        if train and self.trains:
            self.aggregator.join(client_id)  # outside the runtime lock: the aggregator may step the trunk
        return result

    def _forward(self, client_id: str, activation_id: str, state: CutState, train: bool, num_examples: int,
                 retry: bool, arrivals: Sequence[Arrival] = (), reply: ReplySink | None = None
                 ) -> tuple[Any, int]:
        with self._lock:
            if train:
                existing = self.store.find(activation_id)
                if existing is not None or self.store.done(activation_id) is not None:
                    if retry and existing is not None and existing.client_id == client_id:
                        return self.deliver([(existing.out_value, reply)])[0], existing.version
                    raise DuplicateActivationError(
                        f"activation id {activation_id!r} is already in use; use a fresh id per forward")
                self.store.admit(client_id, 2 * state.hidden.numel() * state.hidden.element_size())
            self.bring(arrivals)
            state = self.brought(state, arrivals)
            inputs, leaf = self._prepare(state, train)
            self.stats["forwards"] += 1
            if not train:
                with torch.no_grad(), self._autocast(), busy_on_oom("forward"):
                    return self.deliver([(self.trunk(inputs).hidden, reply)])[0], self._version
            weights = self.aggregator.weights_for(client_id)  # a per-client copy, or None: the shared trunk
            copy = self._copies.for_forward(self, weights)  # async with several clients: its version's weights
            if self.checkpointing:  # keep the input and the output only; the backward recomputes
                rng = rng_state(self.device)
                with torch.no_grad(), self._autocast(), busy_on_oom("forward"):
                    out_value = self._run(inputs, weights)
                output = None
                nbytes = sum(t.numel() * t.element_size() for t in (inputs.hidden, out_value))
            else:
                with TIMELINE.gpu("forward", n=1):
                    output, nbytes, rng = self.traced_forward(inputs, weights if copy is None else copy.params)
                out_value = output.detach()
            self.store.admit(client_id, nbytes)
            self.store.add(SavedForward(activation_id, client_id, self._version, inputs.with_hidden(leaf), output,
                                        out_value, nbytes, max(int(num_examples), 1), rng, frozen=copy,
                                        weights=weights))
            return self.deliver([(out_value, reply)])[0], self._version

    def _run(self, inputs: CutState, weights: list[torch.Tensor] | None) -> torch.Tensor:
        """The trunk's output hidden state, on its own weights or on ``weights`` (its trainable ones replaced)."""
        if weights is None:
            return self.trunk(inputs).hidden
        return functional_call(self.trunk, dict(zip(self._names, weights)), (inputs,)).hidden

    def traced_forward(self, inputs: CutState, weights: list[torch.Tensor] | None = None
                       ) -> tuple[torch.Tensor, int, Any]:
        """The trunk on prepared ``inputs`` (on ``weights``, see :meth:`_run`), keeping its graph: (output, bytes
        held for the backward, output included, and the RNG state the forward started from, for a recompute)."""
        own = list(self.trunk.parameters()) + list(weights or ())
        counter = SavedBytes({p.untyped_storage().data_ptr() for p in own})
        rng = rng_state(self.device)
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack), self._autocast(), \
                busy_on_oom("forward"):
            output = self._run(inputs, weights)
        return output, counter.nbytes + output.numel() * output.element_size(), rng

    def forward_request(self, request: ForwardRequest) -> tuple[torch.Tensor, int]:
        """:meth:`forward` of a queued :class:`ForwardRequest`."""
        r = request
        self._device_out = r.device_out
        try:
            return self.forward(r.client_id, r.activation_id, r.state, train=r.train, num_examples=r.num_examples,
                                retry=r.retry, arrivals=r.arrivals, reply=r.reply)
        finally:
            self._device_out = False

    def can_batch(self, request: ForwardRequest) -> bool:
        """Whether ``request`` may share a trunk call with other clients' forwards.

        Evaluation forwards always may. Training forwards may in ``sync`` and
        ``quorum`` modes, where a step applies a sum of gradients and the
        batch's backward gives it that sum at once (a batch the trunk stepped
        under is recomputed on the weights it saw); in ``async`` mode each
        client's gradient is a step of its own, so they run one by one.
        """
        return self._batches.can_batch(request)

    def forward_many(self, requests: list[ForwardRequest]) -> list[tuple[torch.Tensor, int] | BaseException]:
        """Forwards of several clients, batched where they can be; each entry is its request's result or
        error."""
        return self._batches.forward_many(requests)

    # -- backward ------------------------------------------------------------
    def start_backward(self, client_id: str, activation_id: str, grad: torch.Tensor, *, retry: bool = False,
                       reply_check: ReplyCheck | None = None, step: StepPart | None = None,
                       device_out: bool = False, arrivals: Sequence[Arrival] = (),
                       reply: ReplySink | None = None) -> PendingBackward:
        """Gradient of the loss w.r.t. the forward's input now; the trunk's gradient goes to the aggregator.

        Never waits for other clients. ``reply_check`` sees the input's shape
        before anything is consumed, so a reply that could not be delivered is
        refused with the saved forward still in place. A retried request
        (``retry``) for a Backward already computed gets the same answer and the
        same outcome, never a second contribution. ``step``: this backward is one
        micro-batch of a client step (see :mod:`splitfed.trunk.aggregation.microsteps`). ``device_out``: hand the input
        gradient back on the trunk's device. ``arrivals``: ``grad`` is still in host memory (see :meth:`bring`;
        for a member of a batch, brought with the other members' when the batch's backward runs); ``reply``: where
        the input gradient goes (see :meth:`deliver`).
        """
        with self._lock:
            if retry:
                done = self.store.done(activation_id)
                if done is not None:
                    if done.client_id != client_id:
                        raise PermissionDeniedError(f"activation {activation_id} belongs to another client")
                    return PendingBackward(done.grad_in, done.result)
            entry = self.store.get(activation_id, client_id)
            if tuple(grad.shape) != tuple(entry.out_value.shape):
                raise TensorValueError(f"gradient shape {list(grad.shape)} differs from the forward's output "
                                       f"shape {list(entry.out_value.shape)}")
            if not grad.is_floating_point():
                raise TensorValueError(f"gradient must be a floating tensor, got {grad.dtype}")
            if reply_check is not None:
                reply_check(tuple(entry.inputs.hidden.shape))
            if step is not None:
                self.micro.check(client_id, step, batched=entry.group is not None)
            if entry.group is None and arrivals:
                self.bring(arrivals)
                grad = arrivals[0].tensor
            self.store.pop(activation_id)
            if entry.group is not None:  # a member of a batch: checked with the others when the batch completes
                pending, complete = self._batches.receive(entry, grad, tuple(arrivals), reply)
            else:
                try:
                    dtype = entry.out_value.dtype
                    with TIMELINE.gpu("backward", n=1):
                        grads = self._gradients(entry, grad.to(self.device, dtype) if self._staging is None else
                                                self._staging.to_device(grad, dtype))
                except RuntimeError as exc:  # out of memory included: the graph is spent, so no retry of this one
                    raise TrunkStepError(f"the backward of {activation_id} failed on the server: {exc}; run the "
                                         "forward again") from None
                self.stats["backwards"] += 1
                grad_in, trunk_grads = grads[0], list(grads[1:])
                assert grad_in is not None
        if entry.group is not None:
            self.aggregator.join(client_id)  # a gradient is a sign of life
            if complete is not None:
                if self.defer is not None:
                    self.defer(lambda: self._batches.finish_or_fail(complete))
                else:
                    self._batches.finish(complete)
            elif self.bring_early and self.defer is not None and self._batches.bring_due(entry.group):
                self.defer(lambda group=entry.group: self._batches.bring_gradients(group))
            return pending
        result = self._submit(client_id, entry.version, trunk_grads, entry.num_examples) if step is None else \
            self.micro.offer(client_id, step, activation_id, entry.version, trunk_grads, entry.num_examples,
                             self._submit)
        pending = PendingBackward(resolved(grad_in if device_out else self.deliver([(grad_in, reply)])[0]), result)
        with self._lock:
            self.store.remember(activation_id, DoneBackward(client_id, pending.grad_in, result,
                                                            grad_in.numel() * grad_in.element_size()))
        return pending

    def stepping(self) -> set[str]:
        """Clients whose forward for the coming step ran: its saved forward waits for the backward, its gradient
        for its batch's backward, or its contribution for the step."""
        return self.store.clients() | self._batches.awaiting() | self.aggregator.offered

    def joins_batch(self, activation_id: str) -> bool:
        """Whether the Backward of ``activation_id`` only joins a batch (its forward ran batched) or answers a
        retry: light work, with no backward to compute."""
        with self._lock:
            entry = self.store.find(activation_id)
            return (entry is not None and entry.group is not None) or self.store.done(activation_id) is not None

    def _gradients(self, entry: SavedForward, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs = [entry.inputs.hidden]
        if entry.output is not None:  # its graph: on the live weights, a per-client copy or its version's copy
            output = entry.output
            seen = entry.weights if entry.weights is not None else entry.frozen_params
            targets = inputs + (self._trainable if seen is None else list(seen))
        else:  # rebased or checkpointed: recompute on the weights this forward saw, with its RNG state
            self.stats["recomputed"] += 1
            frozen = entry.frozen_params if entry.frozen_params is not None else entry.weights
            # frozen None: checkpointed, and the trunk has not stepped since
            output = rerun(self.trunk, self._names, entry.inputs, entry.rng_state, frozen, self._autocast())
            targets = inputs + (self._trainable if frozen is None else list(frozen))
        if not self.trains:
            targets = inputs
        grads = torch.autograd.grad(output, targets, grad, allow_unused=True)
        if grads[0] is None:
            grads = (torch.zeros_like(entry.inputs.hidden),) + grads[1:]
        return grads

    def _submit(self, client_id: str, version: int, trunk_grads: Grads, num_examples: int,
                members: tuple[str, ...] = ()) -> Future[Result]:
        if not self.trains:
            return resolved(Result(Outcome.NOT_TRAINED, self._version, 0, 0.0))
        with TIMELINE.host("guard"):
            refused = self.guard.check(trunk_grads)
        if refused is not None:
            log.warning("gradient guard refused client %s's gradient: %s", ", ".join(members or (client_id,)),
                        refused)
            trunk_grads = None  # type: ignore[assignment]
        TIMELINE.mark("offer", n=len(members) or 1)
        return self.aggregator.offer(Contribution(client_id, version, trunk_grads, num_examples, members=members))

    # -- optimizer step --------------------------------------------------------
    def _apply_update(self, update: Grads) -> None:
        """Set the trunk's gradients to ``update`` and take one optimizer step (called by the aggregator)."""
        assert self.optimizer is not None
        with self._lock:
            self._rebase_pending()
            try:
                with TIMELINE.gpu("step"):
                    for p, g in zip(self._trainable, update):
                        p.grad = None if g is None else g.to(p.dtype)
                    self.optimizer.step()
            finally:
                self.optimizer.zero_grad(set_to_none=True)
            self._version += 1
            TIMELINE.mark("step", version=self._version)

    def _rebase_pending(self) -> None:
        """Give forwards still waiting for their backward the weights they saw (before this step)."""
        self._copies.before_step(self)
