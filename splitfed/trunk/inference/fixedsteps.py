"""A decode group's steps over a fixed-size KV cache, captured once as a CUDA graph and replayed.

A decode step of a small trunk is bound by the host, not the GPU: a GPT-2-small
trunk of 12 blocks launches a few hundred small kernels per step, and Python
and the dispatcher take several milliseconds to launch them while the GPU
computes each in microseconds. A CUDA graph launches them all at once.

A graph replays fixed shapes at fixed addresses, so a group that takes fixed
steps (:class:`FixedSteps`) keeps its stacked cache in buffers of a fixed
capacity (a multiple of :data:`CAPACITY_STEP` positions, the group's padded
length rounded up). A step writes its keys and values into the next column of
those buffers (``index_copy_`` at a column held on the device,
:class:`~splitfed.split.fixedcache.ColumnCache`) and attends over the whole buffer under a boolean mask that
is 0 past the group's length: the same keys as the growing cache, so the same
result up to float rounding. The mask (built on the host, as for any batched
step), the positions and the hidden states are copied into fixed input buffers
before each replay.

A graph is captured on a group's first step (and again when the group outgrows
its capacity, or when a trunk weight was given new storage or replaced by a new
tensor: in-place optimizer steps and ``load_state_dict`` keep the storage, and a
replay reads the weights as they are). Captures run on a side stream in thread-local
mode, so the server's other threads go on copying meanwhile
(:func:`~splitfed.split.fixedcache.capture`).

``decode_steps`` (:class:`~splitfed.trunk.inference.sessions.SessionManager`) chooses:
``"auto"`` (graphs on a GPU, the growing cache elsewhere), ``"graphs"``,
``"fixed"`` (the fixed-size cache without graphs: what the graphs replay, on any
device) or ``"dynamic"`` (the growing cache). Trunks that qualify:
:meth:`~splitfed.split.transformer.TransformerPart.fixed_decoding` (GPT-2 and
the Llama family with every block attending to the full past through SDPA), not
compiled; other groups step over the growing cache.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from splitfed.errors import ConfigError
from splitfed.split.base import CutState
from splitfed.split.fixedcache import ColumnCache, capture, column_layers

if TYPE_CHECKING:
    from splitfed.trunk.compute.runtime import TrunkRuntime
    from splitfed.trunk.inference.decodegroup import DecodeGroup

log = logging.getLogger(__name__)

#: a fixed-size cache's capacity is a multiple of this many positions
CAPACITY_STEP = 128
#: the choices of ``decode_steps``
DECODE_STEPS = ("auto", "graphs", "fixed", "dynamic")


#: parameters and buffers registered on any module since import (a weight replaced by a new tensor registers one)
_registered = [0]


def _count_registration(*args: Any) -> None:
    _registered[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)
torch.nn.modules.module.register_module_buffer_registration_hook(_count_registration)


def check_decode_steps(choice: str) -> str:
    """``choice`` if it is one of :data:`DECODE_STEPS`, else :class:`ConfigError`."""
    if choice not in DECODE_STEPS:
        raise ConfigError(f"decode_steps must be one of {', '.join(DECODE_STEPS)}; got {choice!r}")
    return choice


def capacity_for(length: int) -> int:
    """The capacity of a fixed-size cache holding ``length`` positions with room for at least one more."""
    return (length // CAPACITY_STEP + 1) * CAPACITY_STEP


def chosen(runtime: TrunkRuntime, choice: str) -> str | None:
    """What decode groups on ``runtime`` take under ``decode_steps=choice``: ``"graphs"``, ``"fixed"`` or None (the
    growing cache): fixed steps where the choice asks for them and the trunk qualifies."""
    graphs = choice == "graphs" or (choice == "auto" and runtime.device.type == "cuda")
    if not graphs and choice != "fixed":
        return None
    check = getattr(runtime.trunk, "fixed_decoding", None)
    if check is None or not check() or getattr(runtime, "compiled", False):
        return None
    return "graphs" if graphs else "fixed"


class FixedSteps:
    """A :class:`~splitfed.trunk.inference.decodegroup.DecodeGroup`'s one-position steps over a fixed-size cache.

    Built from a freshly stacked group: its growing cache becomes a :class:`ColumnCache` of
    :func:`capacity_for` its length (the group's ``cache`` is replaced). ``graphs``: capture each step's work as
    a CUDA graph and replay it (a GPU runtime only).
    """

    def __init__(self, runtime: TrunkRuntime, group: DecodeGroup, graphs: bool) -> None:
        self.runtime = runtime
        self.group = group
        self.graphs = graphs and runtime.device.type == "cuda"
        self.captures = 0
        #: set when a capture failed: the group then steps without graphs, and so should later groups
        self.capture_failed = False
        device = runtime.device
        first = group.cache.layers[0].keys
        self.rows = int(first.shape[0])
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        self.capacity = 0
        self.cache = ColumnCache([], self.column)
        self._resize(capacity_for(group.length), [(layer.keys, layer.values) for layer in group.cache.layers])
        width = int(getattr(runtime.trunk.config, "hidden_size"))
        self.hidden = torch.zeros(self.rows, 1, width, dtype=runtime.dtype, device=device)
        self.positions = torch.zeros(self.rows, 1, dtype=torch.long, device=device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._out: torch.Tensor | None = None
        self._registered = -1
        self._tensors: list[torch.Tensor] = []
        self._pointers: list[int] = []

    def _resize(self, capacity: int, stored: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """New buffers of ``capacity`` columns holding the group's ``length`` columns of ``stored``."""
        layers = column_layers(stored, self.group.length, capacity)
        self.cache.layers = layers
        self.capacity = capacity
        self.mask = torch.zeros(self.rows, 1, 1, capacity, dtype=torch.bool, device=self.runtime.device)
        self.group.cache = self.cache
        self._graph, self._out = None, None  # shapes changed: capture again

    def step(self, state: CutState) -> torch.Tensor:
        """The group's step on ``state`` (:meth:`DecodeGroup.inputs`: one position per row, a 2-D mask over the
        group's positions and this one, the rows' positions); returns the output hidden states, a new tensor."""
        rt = self.runtime
        rt.check_input(state)
        length, new = self.group.length, int(state.hidden.shape[1])
        if new != 1 or state.attention_mask is None or state.position_ids is None:
            raise ValueError("a fixed decode step takes one position per row, with its mask and positions")
        if length + new > self.capacity:
            self._resize(capacity_for(length), [(layer.keys, layer.values) for layer in self.cache.layers])
        cuda = rt.device.type == "cuda"
        host = torch.zeros(self.rows, self.capacity, dtype=torch.bool, pin_memory=cuda)
        host[:, : length + new] = state.attention_mask
        self.mask.copy_(host.view(self.mask.shape), non_blocking=cuda)
        positions = state.position_ids.to(dtype=torch.long).expand(self.rows, new)
        self.positions.copy_(positions.pin_memory() if cuda and not positions.is_cuda else positions,
                             non_blocking=cuda)
        self.hidden.copy_(state.hidden, non_blocking=cuda)
        self.column.fill_(length)
        if not self.graphs:
            return self._forward()
        if self._graph is None or self._moved():
            try:
                self._capture()
            except RuntimeError as exc:  # an operation a graph cannot hold (one that waits for the device, say)
                log.warning("could not capture a decode step as a CUDA graph (%s); decode groups step without "
                            "graphs from now on (decode_steps='fixed')", exc)
                self.graphs, self.capture_failed = False, True
                return self._forward()
        assert self._graph is not None and self._out is not None
        self._graph.replay()
        return self._out.clone()

    def _moved(self) -> bool:
        """Whether a weight the graph reads moved since the capture: a tensor was registered on some module (a
        replaced parameter or buffer), or one of the trunk's was given new storage (``param.data = ...``)."""
        return self._registered != _registered[0] or any(
            t.data_ptr() != p for t, p in zip(self._tensors, self._pointers))

    def _weights(self) -> None:
        trunk = self.runtime.trunk
        self._registered = _registered[0]
        self._tensors = [*trunk.parameters(), *trunk.buffers()]
        self._pointers = [t.data_ptr() for t in self._tensors]

    def _forward(self) -> torch.Tensor:
        from splitfed.trunk.inference.decoding import evaluating

        rt = self.runtime
        with evaluating(rt.trunk), torch.no_grad(), rt._autocast(cache=False):
            return rt.trunk.decode_fixed(self.hidden, self.mask, self.positions, self.column, self.cache)

    def _capture(self) -> None:
        """Capture this step's work as a graph (:func:`~splitfed.split.fixedcache.capture`: its warm-up run writes
        the same columns the replay then writes again)."""
        self._graph, self._out = None, None
        self._graph, self._out = capture(self._forward, self.runtime.device)
        self._weights()
        self.captures += 1
        log.debug("captured a decode step of %d rows over %d positions as a CUDA graph", self.rows, self.capacity)


def attach(runtime: TrunkRuntime, group: DecodeGroup, choice: str) -> None:
    """Give a freshly stacked ``group`` fixed steps where ``choice`` (``decode_steps``) and its trunk allow."""
    kind = chosen(runtime, choice)
    if kind is not None and not group.sliding and all(layer.keys.dim() == 4 for layer in group.cache.layers):
        group.fixed = FixedSteps(runtime, group, kind == "graphs")
