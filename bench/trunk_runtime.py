"""The trunk runtime without the channel: the server's device work for N clients, driven from one thread.

Each sync step hands the runtime every client's training forward (in one batch, or in batches of varying size
as a server's windows close), then every client's gradient, as the servicer would, and waits for the step.
Inputs come from pinned host memory, as they do from a client's shared-memory region. Compared with
:mod:`bench.ceiling` (plain PyTorch on the same rows) it shows what the runtime itself costs, apart from gRPC and
the clients: ``runtime_ceiling_fraction_<N>``.

``python -m bench.trunk_runtime --device cuda --clients 32 --config "layers=12 hidden=768 heads=12 vocab=50257
batch=4 seq=256 bf16=1" --vary`` (``--profile``: a torch.profiler table of one step, CPU ops and CUDA calls).
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time
import uuid
from typing import Any

import torch

from bench import core
from bench.ceiling import ceiling

log = logging.getLogger("bench.trunk_runtime")


def _runtime(device: str) -> Any:
    from splitfed.split import split_model
    from splitfed.trunk.aggregation import make_aggregator
    from splitfed.trunk.runtime import TrunkRuntime
    from splitfed.trunk.store import StoreLimits

    trunk = split_model(core._gpt2().to(device), core._cuts()).trunk
    runtime = TrunkRuntime(trunk, torch.optim.SGD(trunk.parameters(), lr=1e-4), aggregator=make_aggregator(
        "sync", timeout=300), limits=StoreLimits(max_bytes=1 << 40),
        autocast_dtype=torch.bfloat16 if core.SPLIT_STEP["bf16"] else None)
    runtime.host_outputs = True  # as a server's runtime
    return runtime


def _sizes(clients: int, vary: bool, rng: random.Random) -> list[int]:
    """How a step's forwards fall into batches: all at once, or 1-3 batches of random sizes."""
    if not vary or clients < 3:
        return [clients]
    cuts = sorted(rng.sample(range(1, clients), rng.randint(1, 2)))
    return [b - a for a, b in zip([0, *cuts], [*cuts, clients])]


def run(device: str = "cpu", clients: int = 8, steps: int = 5, warmup: int = 2, vary: bool = False,
        profile: bool = False) -> dict[str, Any]:
    """Examples per second of the runtime's sync steps over ``clients`` clients' rows."""
    from splitfed.split import CutState
    from splitfed.trunk.requests import ForwardRequest

    c = core.SPLIT_STEP
    rt = _runtime(device)
    pin = device.startswith("cuda")
    hidden = [torch.randn(c["batch"], c["seq"], c["hidden"], pin_memory=pin) for _ in range(clients)]
    grads = [(torch.randn(c["batch"], c["seq"], c["hidden"]) * 1e-3).pin_memory() if pin else
             torch.randn(c["batch"], c["seq"], c["hidden"]) * 1e-3 for _ in range(clients)]
    names = [f"c{i}" for i in range(clients)]
    for name in names:
        rt.join(name)
    rng = random.Random(0)

    def step() -> None:
        acts = [uuid.uuid4().hex for _ in names]
        requests = [ForwardRequest(n, a, CutState(h), True, c["batch"]) for n, a, h in zip(names, acts, hidden)]
        at = 0
        for size in _sizes(clients, vary, rng):
            chunk = requests[at: at + size]
            results = rt.forward_many(chunk) if size > 1 else [rt.forward_request(chunk[0])]
            for r in results:
                if isinstance(r, BaseException):
                    raise r
            at += size
        pending = [rt.start_backward(n, a, g) for n, a, g in zip(names, acts, grads)]
        for p in pending:
            p.grad_in.result(60)
            p.result.result(60)

    for _ in range(warmup):
        step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    out: dict[str, Any] = {f"runtime_examples_per_s_{clients}{'_varied' if vary else ''}":
                           clients * c["batch"] / statistics.median(times)}
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
        with torch_profile(activities=activities) as prof:
            step()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trunk_runtime", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--vary", action="store_true", help="forwards in 1-3 batches of random sizes per step")
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler table of one step")
    parser.add_argument("--config", default="", help="model and batch, as bench.trunk's --config")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    for item in args.config.split():
        key, _, value = item.partition("=")
        if key not in core.SPLIT_STEP:
            parser.error(f"--config: unknown key {key!r}; known: {', '.join(core.SPLIT_STEP)}")
        core.SPLIT_STEP[key] = int(value)
    results: dict[str, Any] = run(args.device, args.clients, args.steps, vary=args.vary, profile=args.profile)
    roof = ceiling(args.device, args.clients, steps=args.steps, repeat=1)
    results[f"ceiling_examples_per_s_{args.clients}_batched"] = roof["batched"]
    key = next(iter(k for k in results if k.startswith("runtime_examples")))
    results[f"runtime_ceiling_fraction_{args.clients}{'_varied' if args.vary else ''}"] = results[key] / roof["batched"]
    results["config"] = " ".join(f"{k}={v}" for k, v in core.SPLIT_STEP.items())
    core.print_results(results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
