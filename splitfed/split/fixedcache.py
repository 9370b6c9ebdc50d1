"""A KV cache of fixed size, and capturing a step over it as a CUDA graph.

A decode step of a small transformer part is bound by the host: a few blocks
launch a few hundred small kernels, which Python and the dispatcher take
milliseconds to launch while the GPU computes each in microseconds. A CUDA
graph launches them all at once, but it replays fixed shapes at fixed
addresses. :class:`ColumnCache` keeps a part's keys and values in buffers of a
fixed capacity: a step writes its one position into the column a device tensor
holds (``index_copy_``), and attention reads the whole buffer under a boolean
mask that hides the columns past the step. The same keys as a growing cache,
so the same result up to float rounding.

Used by the trunk's decode groups (:mod:`splitfed.trunk.inference.fixedsteps`)
and by a client's own bottom and top while it generates
(:mod:`splitfed.client.decoding`). Plain torch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)


class ColumnLayer:
    """One layer's keys and values at a fixed capacity, ``(batch, heads, capacity, head_dim)``."""

    is_initialized = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys = keys
        self.values = values


class ColumnCache:
    """A KV cache of fixed capacity that each step writes at the columns ``column`` holds (a device tensor).

    What the blocks call of a cache is :meth:`update`: the new keys and values go into their columns and the whole
    buffers come back, so that attention reads every column (the mask hides those past the step).
    """

    def __init__(self, layers: list[ColumnLayer], column: torch.Tensor) -> None:
        self.layers = layers
        self.column = column

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``key_states``/``value_states`` at :attr:`column`; return the layer's whole buffers."""
        layer = self.layers[layer_idx]
        layer.keys.index_copy_(2, self.column, key_states.to(layer.keys.dtype))
        layer.values.index_copy_(2, self.column, value_states.to(layer.values.dtype))
        return layer.keys, layer.values


def column_layers(stored: list[tuple[torch.Tensor, torch.Tensor]], length: int, capacity: int) -> list[ColumnLayer]:
    """New buffers of ``capacity`` columns holding the first ``length`` columns of each layer's ``(keys, values)``."""
    layers = []
    for keys, values in stored:
        k = keys.new_zeros(keys.shape[0], keys.shape[1], capacity, keys.shape[3])
        v = values.new_zeros(values.shape[0], values.shape[1], capacity, values.shape[3])
        k[:, :, :length] = keys[:, :, :length]
        v[:, :, :length] = values[:, :, :length]
        layers.append(ColumnLayer(k, v))
    return layers


def capture(step: Callable[[], torch.Tensor], device: torch.device) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture ``step()`` as a CUDA graph on ``device``; returns the graph and the output tensor its replays fill.

    A warm-up run of ``step`` goes first (it must be safe to run twice: a decode step writes the same columns
    again), then the capture, both on a side stream in thread-local mode, so that other threads of the process go
    on using the device meanwhile. Raises ``RuntimeError`` where an operation cannot be captured (one that waits for
    the device, say); the device's random generator is then left usable.
    """
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device=device)
    side.wait_stream(current)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(side):
            step()
            graph.capture_begin(capture_error_mode="thread_local")
            ending = False
            try:
                out = step()
                ending = True
                graph.capture_end()  # raises where an operation made the capture invalid
            except BaseException:
                if not ending:
                    with contextlib.suppress(RuntimeError):  # the capture is invalid already; end it
                        graph.capture_end()
                release_generator(device)
                raise
    finally:
        current.wait_stream(side)
    return graph, out


def release_generator(device: torch.device) -> None:
    """After a capture that failed midway: give the device's default random generator a copy of its state that is
    not marked as capturing (a capture that does not end cleanly leaves it so, and every later random draw on the
    device would fail)."""
    gen = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    clone, set_state = getattr(gen, "clone_state", None), getattr(gen, "graphsafe_set_state", None)
    if clone is not None and set_state is not None:
        set_state(clone())
