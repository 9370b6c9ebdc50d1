"""The kernels a served trunk step runs that plain PyTorch does not: one step's device work, side by side.

``torch.profiler`` records ``--steps`` sync steps of the server's runtime (:mod:`bench.trunk_runtime`: each
client's activation brought from pinned memory, the batch's NaN/Inf check, the forward, the gradients brought
and checked, the backward, the step, the replies sent back by the copy engine) and as many steps of the ceiling
(:mod:`bench.ceiling`: one forward and backward over every client's rows, then the step), both over the same
rows. Each side's device events (kernels, copies, fills) are summed by name per step; the table lists every name
whose time per step differs, the server's extra first: what to work down to bring the server to the ceiling.

``python -m bench.kernel_diff --device cuda --clients 32 --config "layers=12 hidden=768 heads=12 vocab=50257
batch=4 seq=256 bf16=1" [--compile] [--batches 2] --json``. Off a GPU the same table is made of the host's
top-level operators (``cpu_op`` events with no operator around them), which shows the host side's extra calls.

Keys: ``kernel_diff_served_gpu_ms``, ``kernel_diff_ceiling_gpu_ms`` (device time per step, summed over events;
copies on the copy engine overlap kernels, so the sum can exceed the step), ``kernel_diff_extra_ms`` (their
difference), ``kernel_diff_only_served_ms`` (names the ceiling never runs) and ``kernel_diff_rows``: the
table's rows, each ``[name, served calls, served us, ceiling calls, ceiling us]`` per step.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bench import core
from bench.gpu_gaps import DEVICE_CATEGORIES, load

log = logging.getLogger("bench.kernel_diff")


@dataclass(frozen=True)
class Row:
    """One event name's calls and microseconds per step on each side."""

    name: str
    served_calls: float
    served_us: float
    ceiling_calls: float
    ceiling_us: float

    @property
    def extra_us(self) -> float:
        return self.served_us - self.ceiling_us


def _top_level(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Host operators not inside another operator of the same thread."""
    out: list[dict[str, Any]] = []
    by_thread: dict[Any, list[dict[str, Any]]] = {}
    for e in events:
        by_thread.setdefault(e.get("tid"), []).append(e)
    for thread in by_thread.values():
        thread.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        end = float("-inf")
        for e in thread:
            if float(e["ts"]) >= end:
                out.append(e)
                end = float(e["ts"]) + float(e.get("dur", 0.0))
    return out


def table(trace: dict[str, Any] | Sequence[dict[str, Any]], steps: int, device: bool = True
          ) -> dict[str, tuple[float, float]]:
    """``name -> (calls, microseconds)`` per step: the device's events (``device``) or the host's top-level
    operators, of a Chrome trace of ``steps`` steps."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    complete = [e for e in events if e.get("ph") == "X" and "ts" in e]
    chosen: Iterable[dict[str, Any]]
    if device:
        chosen = [e for e in complete if e.get("cat") in DEVICE_CATEGORIES]
    else:
        chosen = _top_level([e for e in complete if e.get("cat") == "cpu_op"])
    out: dict[str, tuple[float, float]] = {}
    for e in chosen:
        name = str(e.get("name", "?"))[:120]
        calls, us = out.get(name, (0.0, 0.0))
        out[name] = (calls + 1, us + float(e.get("dur", 0.0)))
    return {k: (calls / steps, us / steps) for k, (calls, us) in out.items()}


def diff(served: dict[str, tuple[float, float]], ceiling: dict[str, tuple[float, float]],
         min_us: float = 1.0) -> list[Row]:
    """Every name whose time per step differs by at least ``min_us``, the server's largest extra first."""
    rows = []
    for name in served.keys() | ceiling.keys():
        sc, su = served.get(name, (0.0, 0.0))
        cc, cu = ceiling.get(name, (0.0, 0.0))
        if abs(su - cu) >= min_us:
            rows.append(Row(name, sc, su, cc, cu))
    rows.sort(key=lambda r: -r.extra_us)
    return rows


def _profiled(step: Callable[[], None], steps: int, cuda: bool, path: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    prof.export_chrome_trace(path)


def run(device: str = "cpu", clients: int = 8, steps: int = 3, warmup: int = 3, compile_blocks: bool = False,
        batches: int = 1, top: int = 25) -> dict[str, Any]:
    """Profile ``steps`` steps of the server's runtime and of the ceiling; return the keys above."""
    from bench.ceiling import stepper as ceiling_stepper
    from bench.trunk_runtime import stepper as runtime_stepper

    cuda = device.startswith("cuda")
    served_step = runtime_stepper(device, clients, batches=batches, compile_blocks=compile_blocks)
    roof = ceiling_stepper(device, clients, compiled=compile_blocks)

    def ceiling_step() -> None:
        roof(True)

    tables = {}
    with tempfile.TemporaryDirectory() as tmp:
        for side, step in (("served", served_step), ("ceiling", ceiling_step)):
            for _ in range(warmup):
                step()
            path = os.path.join(tmp, f"{side}.json")
            _profiled(step, steps, cuda, path)
            tables[side] = table(load(path), steps, device=cuda)
    rows = diff(tables["served"], tables["ceiling"])
    served_ms = sum(us for _, us in tables["served"].values()) / 1e3
    ceiling_ms = sum(us for _, us in tables["ceiling"].values()) / 1e3
    only = sum(r.served_us for r in rows if r.ceiling_calls == 0) / 1e3
    for r in rows[:top]:
        log.warning("%+9.1f us  served %5.1f x %9.1f us  ceiling %5.1f x %9.1f us  %s", r.extra_us, r.served_calls,
                    r.served_us, r.ceiling_calls, r.ceiling_us, r.name)
    return {"kernel_diff_served_gpu_ms" if cuda else "kernel_diff_served_cpu_ms": served_ms,
            "kernel_diff_ceiling_gpu_ms" if cuda else "kernel_diff_ceiling_cpu_ms": ceiling_ms,
            "kernel_diff_extra_ms": served_ms - ceiling_ms, "kernel_diff_only_served_ms": only,
            "kernel_diff_rows": [[r.name, round(r.served_calls, 2), round(r.served_us, 1), round(r.ceiling_calls, 2),
                                  round(r.ceiling_us, 1)] for r in rows[:top]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernel_diff", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps on each side (default 3)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each trunk block on both sides")
    parser.add_argument("--batches", type=int, default=1, help="the server's forwards in this many equal batches")
    parser.add_argument("--top", type=int, default=25, help="rows to log and report (default 25)")
    parser.add_argument("--config", default="", help="model and batch, as bench.trunk's --config")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        core.set_split_step(args.config)
    except ValueError as exc:
        parser.error(str(exc))
    if args.steps < 1 or args.batches < 1:
        parser.error("--steps and --batches must be >= 1")
    results = run(args.device, args.clients, args.steps, compile_blocks=args.compile, batches=args.batches,
                  top=args.top)
    results["config"] = " ".join(f"{k}={v}" for k, v in core.SPLIT_STEP.items())
    core.print_results(results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
