"""What the trunk's device does in plain PyTorch, with no channel: the ceiling ``bench.trunk`` compares the server to.

The same trunk blocks as the server's (``bench.core``'s GPT-2 split at its cuts), the same rows: ``clients``
clients' batches of ``batch x seq`` hidden states, one SGD step per sync step.

* batched: one forward and backward over every client's rows, then the step;
* sequential: each client's rows forward and backward in turn (gradients accumulate), then the step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from bench import core
from bench.gpu_util import UtilSampler


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stepper(device: str = "cpu", clients: int = 4, compiled: bool = False) -> Callable[[bool], None]:
    """The plain-PyTorch trunk step over ``clients`` clients' rows, as a callable: ``step(batched)`` runs one (one
    forward and backward over every row when ``batched``, else each client's rows in turn), then the SGD step."""
    from splitfed.split import CutState, split_model

    c = core.SPLIT_STEP
    dev = torch.device(device)
    trunk = split_model(core._gpt2().to(dev), core._cuts()).trunk
    if compiled:
        for block in trunk.layers:
            block.compile(dynamic=True)
    opt = torch.optim.SGD(trunk.parameters(), lr=1e-4)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bool(c["bf16"]))
    rows = [torch.randn(c["batch"], c["seq"], c["hidden"], device=dev) for _ in range(clients)]
    grads = [torch.randn(c["batch"], c["seq"], c["hidden"], device=dev) * 1e-3 for _ in range(clients)]
    whole, whole_grad = torch.cat(rows), torch.cat(grads)

    def step(batched: bool) -> None:
        pairs = [(whole, whole_grad)] if batched else list(zip(rows, grads))
        for h, g in pairs:
            leaf = h.detach().requires_grad_(True)
            with autocast:
                out = trunk(CutState(leaf.clone())).hidden
            out.backward(g.to(out.dtype))
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def ceiling(device: str = "cpu", clients: int = 4, steps: int = 5, warmup: int = 2, repeat: int = 3,
            compiled: bool = False, kinds: tuple[str, ...] = ("batched", "sequential")) -> dict[str, float]:
    """Examples per second of the plain-PyTorch trunk step, batched and sequential (medians of ``repeat``), and on
    a GPU how busy it was over the timed steps (``<kind>_gpu_util_mean``, percent, :mod:`bench.gpu_util`);
    ``compiled``: each block ``torch.compile``'d as a server with ``compile`` does (dynamic shapes)."""
    c = core.SPLIT_STEP
    dev = torch.device(device)
    step = stepper(device, clients, compiled)

    out: dict[str, float] = {}
    for name, batched in (("batched", True), ("sequential", False)):
        if name not in kinds:
            continue
        runs, utils = [], []
        for _ in range(repeat):
            for _ in range(warmup):
                step(batched)
            _sync(dev)
            sampler = UtilSampler(dev).start()  # over the timed steps only
            start = time.perf_counter()
            for _ in range(steps):
                step(batched)
            _sync(dev)
            runs.append(clients * c["batch"] * steps / (time.perf_counter() - start))
            util = sampler.stop()
            if util:
                utils.append(util["mean"])
        out[name] = statistics.median(runs)
        if utils:
            out[f"{name}_gpu_util_mean"] = statistics.median(utils)
    return out


def ceiling_keys(device: str, clients: int, steps: int, repeat: int, compiled: bool = False,
                 kinds: tuple[str, ...] = ("batched", "sequential")) -> dict[str, float]:
    """The ceiling's bench keys: ``ceiling_examples_per_s_<N>_<kind>`` for each of ``kinds`` (``_cpu`` off a GPU) and
    on a GPU ``ceiling_gpu_util_mean_<N>_batched``; with ``compiled`` the same of the compiled blocks' batched step,
    ending in ``_compiled`` (before ``_cpu``)."""
    where = "" if device.startswith("cuda") else "_cpu"
    runs = [("", kinds, ceiling(device, clients, steps=steps, repeat=repeat, kinds=kinds))]
    if compiled:  # the same GPU's own figure with the same compiled blocks
        runs.append(("_compiled", ("batched",), ceiling(device, clients, steps=steps, repeat=repeat, compiled=True,
                                                         kinds=("batched",))))
    out: dict[str, float] = {}
    for tag, measured, roof in runs:
        for kind in measured:
            out[f"ceiling_examples_per_s_{clients}_{kind}{tag}{where}"] = roof[kind]
        if "batched_gpu_util_mean" in roof:  # how busy plain PyTorch keeps the GPU with the same rows
            out[f"ceiling_gpu_util_mean_{clients}_batched{tag}"] = roof["batched_gpu_util_mean"]
    return out
