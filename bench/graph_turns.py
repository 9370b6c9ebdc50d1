"""How long the trunk's device turns take when the host waits for each: eager, compiled, and under CUDA graphs.

A sync step of the trunk server runs its batch's forward, waits for the clients, then runs the batch's backward
and the step: each turn starts on an idle GPU, so a turn lasts as long as its kernels take to launch or to run,
whichever is longer. This bench times those two turns in plain PyTorch on the server's trunk blocks
(``bench.core``'s GPT-2 at its cuts, ``--config`` as ``bench.trunk``), for each way of running them:

* ``eager``: the blocks as they are;
* ``compiled``: each block ``torch.compile``'d with dynamic shapes, as a server with ``compile`` runs them;
* ``graphed``, ``compiled_graphed``: the same, the trunk's forward and backward captured once as CUDA graphs
  (``torch.cuda.make_graphed_callables``) and replayed.

Keys: ``<mode>_<rows>_forward_ms`` and ``_backward_ms`` (medians, the backward turn includes an SGD step),
``<mode>_<rows>_launch_ms`` (host time of both turns before their waits), and ``<mode>_<rows>_max_abs_diff``
(the output and input gradient against eager on the same weights and rows).
``python -m bench.graph_turns --device cuda --rows 64 128 --config "layers=12 hidden=768 heads=12 vocab=50257
batch=4 seq=256 bf16=1"``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any

import torch
from torch import nn

from bench import core
from bench.ceiling import _sync

log = logging.getLogger(__name__)

class _Hidden(nn.Module):
    """The trunk as a function of hidden states alone (what CUDA-graph capture takes)."""

    def __init__(self, trunk: nn.Module) -> None:
        super().__init__()
        self.trunk = trunk

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from splitfed.split import CutState

        return self.trunk(CutState(hidden)).hidden


def _turns(fn: Any, params: list[torch.Tensor], x: torch.Tensor, g: torch.Tensor, autocast: Any, steps: int,
           lr: float = 0.0) -> dict[str, float]:
    """Median milliseconds of the forward turn, the backward turn (with an SGD step of ``lr``; 0 keeps the
    weights) and the host's launching in both, each turn started on an idle device and waited for."""
    fwd, bwd, launch = [], [], []
    for i in range(steps + 3):
        leaf = x.detach().requires_grad_(True)
        _sync(x.device)
        t0 = time.perf_counter()
        with autocast:
            out = fn(leaf)
        t1 = time.perf_counter()
        _sync(x.device)
        t2 = time.perf_counter()
        grads = torch.autograd.grad(out, [leaf, *params], g.to(out.dtype), allow_unused=True)
        with torch.no_grad():
            torch._foreach_add_([p for p, q in zip(params, grads[1:]) if q is not None],
                                [q for q in grads[1:] if q is not None], alpha=-lr)
        t3 = time.perf_counter()
        _sync(x.device)
        t4 = time.perf_counter()
        if i >= 3:
            fwd.append((t2 - t0) * 1e3)
            bwd.append((t4 - t2) * 1e3)
            launch.append((t1 - t0 + t3 - t2) * 1e3)
    return {"forward_ms": statistics.median(fwd), "backward_ms": statistics.median(bwd),
            "launch_ms": statistics.median(launch)}


def measure(rows: tuple[int, ...], steps: int, modes: tuple[str, ...], device: str = "cuda") -> dict[str, Any]:
    """Each mode's turn times at each row count (see the module docstring); a mode that cannot run (CUDA graphs
    off a GPU) gives an ``_error`` key instead."""
    from splitfed.split import split_model

    c = core.SPLIT_STEP
    dev = torch.device(device)
    out: dict[str, float] = {}
    for n in rows:
        x = torch.randn(n, c["seq"], c["hidden"], device=dev)
        g = torch.randn(n, c["seq"], c["hidden"], device=dev) * 1e-3
        reference: tuple[torch.Tensor, torch.Tensor] | None = None
        for mode in modes:
            trunk = split_model(core._gpt2().to(dev), core._cuts()).trunk
            if "compiled" in mode:
                for block in trunk.layers:
                    block.compile(dynamic=True)
            module = _Hidden(trunk)
            params = [p for p in module.parameters() if p.requires_grad]
            # CUDA-graph capture refuses autocast's weight cache; off, the casts are the same, made each time.
            autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bool(c["bf16"]), cache_enabled=False)
            fn: Any = module
            try:
                if "graphed" in mode:
                    if dev.type != "cuda":
                        raise RuntimeError("CUDA graphs need a CUDA device")
                    sample = x.detach().clone().requires_grad_(True)
                    with autocast:
                        fn = torch.cuda.make_graphed_callables(module, (sample,))
                leaf = x.detach().requires_grad_(True)
                with autocast:
                    y = fn(leaf)
                (dx,) = torch.autograd.grad(y, [leaf], g.to(y.dtype))
                pair = (y.detach().float().clone(), dx.detach().float().clone())
                if reference is None:
                    reference = pair
                out[f"{mode}_{n}_max_abs_diff"] = max((pair[0] - reference[0]).abs().max().item(),
                                                      (pair[1] - reference[1]).abs().max().item())
                for key, value in _turns(fn, params, x, g, autocast, steps).items():
                    out[f"{mode}_{n}_{key}"] = value
            except Exception as exc:  # noqa: BLE001 - a mode that cannot run is reported, the others go on
                out[f"{mode}_{n}_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (no graphs: the eager and compiled modes)")
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled", "graphed", "compiled_graphed"])
    parser.add_argument("--config", default="", help='the trunk, as bench.trunk\'s, e.g. "layers=12 hidden=768 '
                        'heads=12 vocab=50257 batch=4 seq=256 bf16=1" (batch is not used: --rows)')
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        core.set_split_step(args.config)
    except ValueError as exc:
        parser.error(str(exc))
    results = measure(tuple(args.rows), args.steps, tuple(args.modes), args.device)
    core.print_results(results, args.json)
    failed = sorted(k for k in results if k.endswith("_error"))
    if failed:
        log.error("these modes did not run: %s", ", ".join(f"{k} ({results[k]})" for k in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
