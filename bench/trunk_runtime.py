"""The trunk runtime without the channel: the server's device work for N clients, driven from one thread.

Each sync step hands the runtime every client's training forward (in one batch, or in batches of varying size
as a server's windows close), then every client's gradient, as the servicer would, and waits for the step.
Inputs come from pinned host memory, as they do from a client's registered shared-memory region. Compared with
:mod:`bench.ceiling` (plain PyTorch on the same rows) it shows what the runtime itself costs, apart from gRPC and
the clients: ``runtime_ceiling_fraction_<N>``.

``python -m bench.trunk_runtime --device cuda --clients 32 --config "layers=12 hidden=768 heads=12 vocab=50257
batch=4 seq=256 bf16=1" --vary`` (``--profile``: a torch.profiler table of one step, CPU ops and CUDA calls;
``--trace FILE``: that step as a Chrome trace, and on a GPU how long the GPU was busy in it and its longest idle
gaps with what the host did meanwhile (:mod:`bench.gpu_gaps`); ``--compile``: each trunk block ``torch.compile``'d, as
``splitfed serve --compile`` does; ``--batches K``: each step's forwards in K equal batches, as a server whose
``max_batch_tokens`` splits a step; ``--sync-debug``: every call of one step that made the host wait for the
GPU, with where it came from).
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from bench import core
from bench.ceiling import ceiling

log = logging.getLogger("bench.trunk_runtime")


def _runtime(device: str, compile_blocks: bool = False) -> Any:
    from splitfed.split import split_model
    from splitfed.trunk.aggregation.modes import make_aggregator
    from splitfed.trunk.compute.runtime import TrunkRuntime
    from splitfed.trunk.compute.store import StoreLimits

    trunk = split_model(core._gpt2().to(device), core._cuts()).trunk
    runtime = TrunkRuntime(trunk, torch.optim.SGD(trunk.parameters(), lr=1e-4), aggregator=make_aggregator(
        "sync", timeout=300), limits=StoreLimits(max_bytes=1 << 40),
        autocast_dtype=torch.bfloat16 if core.SPLIT_STEP["bf16"] else None, compile=compile_blocks)
    runtime.host_outputs = True  # as a server's runtime
    return runtime


def _sizes(clients: int, vary: bool, rng: random.Random, batches: int = 1) -> list[int]:
    """How a step's forwards fall into batches: all at once, ``batches`` equal ones, or 1-3 of random sizes."""
    if not vary or clients < 3:
        base, extra = divmod(clients, max(1, min(batches, clients)))
        return [base + (i < extra) for i in range(max(1, min(batches, clients)))]
    cuts = sorted(rng.sample(range(1, clients), rng.randint(1, 2)))
    return [b - a for a, b in zip([0, *cuts], [*cuts, clients])]


def stepper(device: str = "cpu", clients: int = 8, vary: bool = False, batches: int = 1,
            compile_blocks: bool = False, seed: int = 0) -> Callable[[], None]:
    """One sync step of the server's runtime over ``clients`` clients' rows, as a callable (each call one step).

    As in a server: each activation and gradient waits in pinned host memory (a client's region) as an
    :class:`~splitfed.trunk.device.transfers.Arrival` until the runtime brings its batch, in the wire's dtype (bf16 with
    ``bf16=1``), and each output and input gradient goes back into pinned host memory by the copy engine
    (a :class:`~splitfed.trunk.device.transfers.ReplySink`). ``compile_blocks``: each trunk block ``torch.compile``'d.
    """
    from splitfed.split import CutState
    from splitfed.trunk.device.transfers import ReplySink
    from splitfed.trunk.compute.requests import ForwardRequest

    c = core.SPLIT_STEP
    rt = _runtime(device, compile_blocks)
    pin = device.startswith("cuda")
    wire = torch.bfloat16 if c["bf16"] else torch.float32
    shape = (c["batch"], c["seq"], c["hidden"])

    def host(scale: float) -> torch.Tensor:
        t = (torch.randn(shape) * scale).to(wire)
        return t.pin_memory() if pin else t

    hidden = [host(1.0) for _ in range(clients)]
    grads = [host(1e-3) for _ in range(clients)]
    replies = [torch.empty(shape, dtype=wire, pin_memory=pin) for _ in range(clients)]
    names = [f"c{i}" for i in range(clients)]
    for name in names:
        rt.join(name)
    rng = random.Random(seed)

    def arrival(name: str, t: torch.Tensor) -> Any:
        return rt.io.stage(name, t, t.dtype, tuple(t.shape), pinned=pin)

    def step() -> None:
        acts = [uuid.uuid4().hex for _ in names]
        requests = []
        for i, (n, a) in enumerate(zip(names, acts)):
            got = arrival("hidden", hidden[i])
            requests.append(ForwardRequest(n, a, CutState(got.placeholder), True, c["batch"], arrivals=(got,),
                                           reply=ReplySink(wire, replies[i].view(-1).view(torch.uint8))))
        at = 0
        for size in _sizes(clients, vary, rng, batches):
            chunk = requests[at: at + size]
            results = rt.forward_many(chunk) if size > 1 else [rt.forward_request(chunk[0])]
            for r in results:
                if isinstance(r, BaseException):
                    raise r
            at += size
        pending = []
        for i, (n, a) in enumerate(zip(names, acts)):
            got = arrival("grad", grads[i])
            pending.append(rt.start_backward(n, a, got.placeholder, arrivals=(got,),
                                             reply=ReplySink(wire, replies[i].view(-1).view(torch.uint8))))
        for p in pending:
            p.grad_in.result(60)
            p.result.result(60)

    return step


def run(device: str = "cpu", clients: int = 8, steps: int = 5, warmup: int = 2, vary: bool = False,
        profile: bool = False, batches: int = 1, trace: str = "", sync_debug: bool = False,
        compile_blocks: bool = False) -> dict[str, Any]:
    """Examples per second of the runtime's sync steps over ``clients`` clients' rows (:func:`stepper`)."""
    c = core.SPLIT_STEP
    step = stepper(device, clients, vary, batches, compile_blocks)
    for _ in range(warmup):
        step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    out: dict[str, Any] = {f"runtime_examples_per_s_{clients}{_suffix(vary, batches)}":
                           clients * c["batch"] / statistics.median(times), "step_ms": 1e3 * statistics.median(times)}
    if sync_debug and device.startswith("cuda"):
        out["syncs_per_step"] = _syncs(step)
    if profile or trace:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
        with torch_profile(activities=activities) as prof:
            step()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
        if profile:
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
        if trace:
            prof.export_chrome_trace(trace)
            if device.startswith("cuda"):
                from bench.gpu_gaps import gpu_gaps, load

                report = gpu_gaps(load(trace))
                out.update(report.keys())
                for line in report.lines():
                    log.warning("%s", line)
    return out


def _suffix(vary: bool, batches: int) -> str:
    return "_varied" if vary else (f"_in_{batches}" if batches > 1 else "")


def _syncs(step: Any) -> int:
    """Run one step with CUDA's sync debugging on; log where each synchronizing call came from; return how many."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    seen: dict[str, int] = {}
    for w in caught:
        if "called a synchronizing" not in str(w.message):
            continue
        where = f"{w.filename}:{w.lineno}: {str(w.message)[:120]}"
        seen[where] = seen.get(where, 0) + 1
    for where, n in sorted(seen.items(), key=lambda kv: -kv[1]):
        log.warning("%d x %s", n, where)
    return sum(seen.values())


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trunk_runtime", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--vary", action="store_true", help="forwards in 1-3 batches of random sizes per step")
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler table of one step")
    parser.add_argument("--compile", action="store_true", help="torch.compile each trunk block")
    parser.add_argument("--batches", type=int, default=1, help="each step's forwards in this many equal batches")
    parser.add_argument("--trace", default="", metavar="FILE", help="write one step as a Chrome trace")
    parser.add_argument("--sync-debug", action="store_true",
                        help="log each call of one step that made the host wait for the GPU (CUDA only)")
    parser.add_argument("--config", default="", help="model and batch, as bench.trunk's --config")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    try:
        core.set_split_step(args.config)
    except ValueError as exc:
        parser.error(str(exc))
    if args.batches < 1:
        parser.error("--batches must be >= 1")
    results: dict[str, Any] = run(args.device, args.clients, args.steps, vary=args.vary, profile=args.profile,
                                  batches=args.batches, trace=args.trace, sync_debug=args.sync_debug,
                                  compile_blocks=args.compile)
    roof = ceiling(args.device, args.clients, steps=args.steps, repeat=1)
    results[f"ceiling_examples_per_s_{args.clients}_batched"] = roof["batched"]
    key = next(iter(k for k in results if k.startswith("runtime_examples")))
    results[f"runtime_ceiling_fraction_{args.clients}{_suffix(args.vary, args.batches)}"] = \
        results[key] / roof["batched"]
    results["config"] = " ".join(f"{k}={v}" for k, v in core.SPLIT_STEP.items())
    core.print_results(results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
