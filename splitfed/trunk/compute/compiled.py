"""The trunk's blocks compiled with ``torch.compile``: fewer, fused kernels and far less host time per call.

Eager, a transformer trunk under mixed precision spends much of its GPU time in small elementwise kernels
(casts, activations, norms), each launched from Python by the server's device thread: a GPT-2-small trunk's
forward and backward over 32 clients' rows took the GPU about 50 ms a sync step, compiled 20-22 ms
(``docs/performance.md``, *Compiled blocks*). Each block is compiled in place (``nn.Module.compile``), so
checkpoints, exports and adapters keep their plain state-dict keys, and the glue between blocks (masks,
rotary tables) stays eager. Blocks compile with dynamic shapes, so one graph serves every batch size and
length (a batch or length of 1 compiles once more: PyTorch specializes on size 1); :func:`warm_up` compiles
them before the first client comes, so no call waits for a compile.

Compiled kernels round differently from eager ones (fused reductions), so a compiled trunk matches the
eager one to float rounding, not bit for bit. Inference sessions (a KV cache grows every step) run the blocks
eagerly: see :func:`eager`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)


def compile_blocks(trunk: nn.Module) -> int:
    """Compile ``trunk``'s blocks in place (each of its ``layers``; a trunk without them as a whole). Returns how
    many modules were compiled."""
    layers = getattr(trunk, "layers", None)
    modules = list(layers) if isinstance(layers, nn.ModuleList) and len(layers) else [trunk]
    for module in modules:
        module.compile(dynamic=True)
    log.info("compiled %d trunk module(s) with torch.compile", len(modules))
    return len(modules)


def is_compiled(trunk: nn.Module) -> bool:
    """Whether ``trunk`` or one of its blocks was compiled in place (``nn.Module.compile``)."""
    layers = getattr(trunk, "layers", None)
    modules = [trunk, *(layers if isinstance(layers, nn.ModuleList) else ())]
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in modules)


def eager() -> contextlib.AbstractContextManager[Any]:
    """A context in which compiled modules run eagerly (``torch.compiler.set_stance("force_eager")``): for calls
    whose shapes change every time, such as decoding steps over a growing KV cache, where compiling would
    recompile again and again."""
    return torch.compiler.set_stance("force_eager")


def warm_up(trunk: nn.Module, device: torch.device, context: Callable[[], contextlib.AbstractContextManager[Any]],
            rows: int = 2, length: int = 16) -> float:
    """Compile a transformer trunk's training forward and backward, and its evaluation forward, each without and
    with a padding mask (a batch of clients whose lengths differ is padded), on random hidden states of ``rows``
    x ``length`` (in ``context``: the runtime's autocast and attention kernels). The training forward and backward
    also run on a copy of the trainable weights (``torch.func.functional_call``), as forwards on the weights of an
    older version do (rebased, async and per-client): PyTorch compiles that variant apart, once, which on a GPU
    host took seconds in the first steps that needed it. Nothing is trained: no gradient reaches the parameters'
    ``.grad``. Returns the seconds it took; a trunk without a ``config.hidden_size`` is left to compile on its
    first call (0.0)."""
    from torch.func import functional_call

    from splitfed.split.base import CutState

    hidden = getattr(getattr(trunk, "config", None), "hidden_size", None)
    if not isinstance(hidden, int):
        return 0.0
    start = time.monotonic()
    dtype = next((p.dtype for p in trunk.parameters() if p.is_floating_point()), torch.float32)
    named = {n: p for n, p in trunk.named_parameters() if p.requires_grad}
    weights = list(named.values())
    padded = torch.ones(rows, length, dtype=torch.long, device=device)
    padded[0, length // 2:] = 0
    was_training = trunk.training
    try:
        for mask in (None, padded):
            x = torch.randn(rows, length, hidden, device=device, dtype=dtype, requires_grad=True)
            trunk.train(was_training)
            with context():
                out = trunk(CutState(x, mask)).hidden
            torch.autograd.grad(out, [x, *weights], torch.ones_like(out), allow_unused=True)
            copies = {n: p.detach().clone().requires_grad_(True) for n, p in named.items()}
            with context():
                out = functional_call(trunk, copies, (CutState(x, mask),)).hidden
            torch.autograd.grad(out, [x, *copies.values()], torch.ones_like(out), allow_unused=True)
            trunk.eval()
            with torch.no_grad(), context():
                trunk(CutState(x.detach(), mask))
    finally:
        trunk.train(was_training)
    seconds = time.monotonic() - start
    log.info("compiled the trunk's training and evaluation graphs in %.1f s", seconds)
    return seconds
