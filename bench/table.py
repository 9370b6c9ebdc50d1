"""The trunk server's performance table in one command: every measure, one card, one JSON object.

Each measure is one of the benches' own commands, run in a process of its own with a time limit; the keys the
table reads are taken from its JSON and printed as the table (measure, value, goal), then as one JSON object (the
last line): per measure its command, exit status, seconds and every key it printed. The run fails (exit status 1)
when a measure fails, runs out of time or does not print a key the table reads, or when ``--budget-s`` leaves a
measure out: a table with holes is not a result.

    python -m bench.table --device cuda --json                      # every measure (about 25 minutes on an H100)
    python -m bench.table --device cuda --only trunk trunk_rows16   # some of them
    python -m bench.table --device cpu --quick                      # tiny configurations: checks that all run

On a GPU the model is GPT-2 small: its trunk (blocks 4..8) serving 32 clients x 4 x 256 positions in bf16 for
the trunk rows (``trunk_medium``: GPT-2 medium's trunk, blocks 8..16 of 24), 16 x 512 for the split step.
``replicas`` runs where the host has 2 or more GPUs (else it is left out, and said so). ``channel`` runs with CUDA hidden: it is the host's per-call CPU work.
``trunk_timeline`` records one batched run's timeline at 32 clients and reads a median sync step off it: where the
GPU waits, and for which calls.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("bench.table")

#: GPT-2 small, the table's model on a GPU (rows per client and positions set per measure).
GPT2_SMALL = "layers=12 hidden=768 heads=12 vocab=50257 seq=256 bf16=1"
#: GPT-2 medium: a bigger trunk (blocks 8..16 of 24, width 1024).
GPT2_MEDIUM = "layers=24 hidden=1024 heads=16 vocab=50257 seq=256 bf16=1"
TINY = "layers=6 hidden=64 heads=2 vocab=256 seq=16"
#: Where ``trunk_timeline`` has ``bench.trunk`` record its timeline (``python -m bench.timeline_plot`` draws it).
TIMELINE_FILE = os.path.join(tempfile.gettempdir(), "splitfed-bench-table-timeline.json")


@dataclass(frozen=True)
class Row:
    """One row of the table: a key of the measure's JSON, what it is, and its goal."""

    key: str
    what: str
    goal: str = ""
    #: Read on a GPU only (NVML's utilization).
    gpu_only: bool = False


@dataclass(frozen=True)
class Measure:
    """A bench command and the rows it fills."""

    name: str
    #: The command's arguments after ``python -m``, given the device, whether the run is ``--quick`` and the client
    #: counts.
    argv: Callable[[str, bool, Sequence[int]], list[str]]
    #: Each row whose key holds ``{n}`` stands for one row per client count.
    rows: tuple[Row, ...]
    #: Seconds the command may run on a GPU / on the CPU.
    limit_s: tuple[float, float] = (600.0, 600.0)
    #: Seconds it took on an H100 host (16 cores): what ``--budget-s`` plans with.
    expect_s: float = 0.0
    env: dict[str, str] = field(default_factory=dict)
    #: GPUs the host must have for the measure to run.
    gpus: int = 0
    #: Client counts of a trunk measure (``--quick``: 2 clients).
    clients: tuple[int, ...] = ()

    def counts(self, quick: bool) -> tuple[int, ...]:
        """The client counts a run takes."""
        return (2,) if quick and self.clients else self.clients


def _trunk(rows: int, *extra: str, only: str = "batched ceiling", model: str = GPT2_SMALL
           ) -> Callable[[str, bool, Sequence[int]], list[str]]:
    def argv(device: str, quick: bool, clients: Sequence[int]) -> list[str]:
        config = f"{TINY} batch=2" if quick else f"{model} batch={rows}"
        return ["bench.trunk", "--device", device, "--clients", *map(str, clients), "--repeat", "1",
                "--steps", "2" if quick else "30", "--frontends", "0" if quick else "4", "--only", *only.split(),
                "--config", config, *extra, "--json"]
    return argv


def _gen_batching(sessions: int, replay: bool = False, *windows: str
                  ) -> Callable[[str, bool, Sequence[int]], list[str]]:
    """``bench.gen_batching`` at ``sessions``; ``windows``: further batching windows (ms) beside the 5 ms one."""
    def argv(device: str, quick: bool, clients: Sequence[int]) -> list[str]:
        return ["bench.gen_batching", "--device", device, "--gen-sessions", str(2 if quick else sessions),
                "--repeat", "1", *([] if replay else ["--no-replay"]),
                *(["--gen-window-ms", "5", *windows] if windows else []),
                *(["--gen-new-tokens", "4"] if quick else []), "--json"]
    return argv


def _split_step(*extra: str) -> Callable[[str, bool, Sequence[int]], list[str]]:
    def argv(device: str, quick: bool, clients: Sequence[int]) -> list[str]:
        config = [] if device == "cpu" else ["--split-config",
                                             "layers=12 hidden=768 heads=12 vocab=50257 batch=16 seq=512 bf16=1"]
        return ["bench", "--only", "split_step", "--device", device, *config, *extra,
                *(["--quick"] if quick else []), "--json"]
    return argv


def _suite(name: str, quick_too: bool = True) -> Callable[[str, bool, Sequence[int]], list[str]]:
    """A suite of ``python -m bench`` (``quick_too``: with ``--quick`` when the table is quick)."""
    def argv(device: str, quick: bool, clients: Sequence[int]) -> list[str]:
        return ["bench", "--only", name, "--device", device, *(["--quick"] if quick and quick_too else []), "--json"]
    return argv


def _measures(gpu: bool) -> list[Measure]:
    cpu = "" if gpu else "_cpu"
    return [
        Measure("trunk", _trunk(4), (
            Row(f"trunk_ceiling_fraction_{{n}}{cpu}", "served / plain PyTorch, {n} clients x 4 rows", ">= 0.8"),
            Row("gpu_util_mean_{n}_batched", "GPU busy serving {n} clients (NVML mean)", ">= 0.8", gpu_only=True),
            Row("ceiling_gpu_util_mean_{n}_batched", "GPU busy in plain PyTorch over the same rows", gpu_only=True),
            Row(f"trunk_requests_per_s_{{n}}_clients_batched{cpu}", "calls per second, {n} clients"),
        ), (420.0, 300.0), clients=(8, 32, 64), expect_s=260.0),
        Measure("trunk_rows16", _trunk(16), (
            Row(f"trunk_ceiling_fraction_{{n}}{cpu}", "served / plain PyTorch, {n} clients x 16 rows", ">= 0.9"),
            Row("gpu_util_mean_{n}_batched", "GPU busy serving them", ">= 0.9", gpu_only=True),
            Row("ceiling_gpu_util_mean_{n}_batched", "GPU busy in plain PyTorch over them", gpu_only=True),
        ), (240.0, 200.0), clients=(32,), expect_s=110.0),
        Measure("trunk_medium", _trunk(4, model=GPT2_MEDIUM), (
            Row(f"trunk_ceiling_fraction_{{n}}{cpu}", "served / plain PyTorch, GPT-2 medium's trunk, {n} clients x 4",
                ">= 0.8"),
            Row("gpu_util_mean_{n}_batched", "GPU busy serving them", gpu_only=True),
            Row("ceiling_gpu_util_mean_{n}_batched", "GPU busy in plain PyTorch over them", gpu_only=True),
        ), (300.0, 200.0), clients=(32,), expect_s=220.0),
        Measure("trunk_timeline", _trunk(4, "--timeline", TIMELINE_FILE, only="batched"), (
            Row("timeline_step_median_ms", "a sync step's median length (ms), clients x 4 rows"),
            Row("timeline_gpu_busy", "the part of it the GPU is busy", gpu_only=True),
            Row("timeline_backward_out_last_ms", "the step's last Backward reply leaves (ms after the step)"),
            Row("timeline_forward_in_last_ms", "the next step's last Forward is in"),
            Row("timeline_hop_window_to_gpu_ms", "its window closes, the GPU's forward starts (ms)", gpu_only=True),
            Row("timeline_forward_out_last_ms", "the forward's last reply leaves (ms after the step)"),
            Row("timeline_backward_in_last_ms", "the last gradient is in"),
            Row("timeline_hop_last_gradient_to_gpu_ms", "the last gradient is in, the GPU's backward starts (ms)",
                gpu_only=True),
        ), (200.0, 200.0), clients=(32,), expect_s=60.0),
        Measure("quorum", _trunk(4, "--mode", "quorum"), (
            Row(f"trunk_ceiling_fraction_{{n}}_quorum{cpu}", "served / plain PyTorch, quorum (k = n/2), {n} clients"),
            Row(f"trunk_examples_per_s_{{n}}_clients_batched_quorum{cpu}", "examples/s, quorum, {n} clients"),
        ), (200.0, 150.0), clients=(32,), expect_s=90.0),
        Measure("async", _trunk(4, "--mode", "async"), (
            Row(f"trunk_ceiling_fraction_{{n}}_async{cpu}", "served / plain PyTorch, async, {n} clients"),
            Row(f"trunk_examples_per_s_{{n}}_clients_batched_async{cpu}", "examples/s, async, {n} clients"),
        ), (200.0, 150.0), clients=(32,), expect_s=150.0),
        Measure("engines", _trunk(4, "--engines", "2", only="batched"), (
            Row(f"engine_scaling_2{cpu}", "2 engines on one device / 1 (intake apart)"),
        ), (200.0, 200.0), clients=(32,), expect_s=110.0),
        Measure("replicas", _trunk(4, "--replicas", "2", only="batched"), (
            Row("replica_scaling_2gpu", "2 GPUs / 1, at the most clients", ">= 1.8"),
        ), (500.0, 300.0), gpus=2, clients=(32, 64), expect_s=400.0),
        Measure("split_step", _split_step("--transports", "auto", "socket", "bulk"), (
            Row("split_step_ratio", "split step / unsplit, shared memory", "<= 1.10"),
            Row("split_step_ratio_socket", "split step / unsplit, socket (gRPC streams)", "<= 1.5"),
            Row("split_step_ratio_bulk", "split step / unsplit, socket (a bulk link of 4 connections)", "<= 1.5"),
        ), (240.0, 240.0), expect_s=60.0),
        Measure("split_step_int8", _split_step("--transports", "socket", "bulk", "--wire-compression", "int8"), (
            Row("split_step_ratio_socket", "split step / unsplit, gRPC streams, int8 at the cut", "<= 1.2"),
            Row("split_step_ratio_bulk", "split step / unsplit, a bulk link, int8 at the cut", "<= 1.2"),
        ), (200.0, 240.0), expect_s=50.0),
        Measure("generation", _suite("generation"), (
            Row("gen_latency_ratio", "split generation / unsplit, per token", "<= 1.2"),
            Row("gen_latency_ratio_process", "the same, the trunk server in a process of its own"),
            Row("gen_latency_ratio_client_dynamic", "the first, the client's bottom and top without decode graphs",
                gpu_only=True),
            Row("gen_direct_share_process", "its calls that went over a region's direct-call link, not gRPC"),
        ), (200.0, 200.0), expect_s=80.0),
        Measure("gen_batching_8", _gen_batching(8), (
            Row("gen_batched_speedup", "batched decoding / one by one, 8 sessions (tokens/s)", ">= 4"),
            Row("gen_trunk_decode_speedup", "the trunk's decode alone, 8 sessions"),
            Row("gen_trunk_prefill_speedup", "the trunk's prefills batched / one by one"),
            Row("gen_client_bound_speedup", "what the clients' own work allows (a server that answered at once)"),
        ), (200.0, 200.0), expect_s=150.0),
        Measure("gen_batching_32", _gen_batching(32, True, "2", "1"), (
            Row("gen_batched_speedup", "batched decoding / one by one, 32 sessions (tokens/s)", ">= 8"),
            Row("gen_batched_speedup_window_2ms", "the same with a 2 ms window (5 ms above), same run"),
            Row("gen_batched_speedup_window_1ms", "the same with a 1 ms window"),
            Row("gen_trunk_decode_speedup", "the trunk's decode alone, 32 sessions"),
            Row("gen_client_bound_speedup", "what the clients' own work allows (a server that answered at once)"),
            Row("gen_client_ms_per_token", "each client's own work per token, ms (median)"),
            Row("gen_replay_batched_speedup", "the same, clients replaying their steps (no client compute)"),
            Row("gen_engine_loop_cores", "cores the batched server's event loop kept busy"),
            Row("gen_engine_device_cores", "cores its device thread kept busy (one interpreter lock with the loop)"),
            Row("gen_engine_loop_us_per_call", "the event loop's CPU per session step, us"),
            Row("gen_engine_loop_turns_per_call", "the event loop's turns per session step"),
            Row("gen_direct_share", "the session steps that went over a region's direct-call link, not gRPC"),
        ), (300.0, 300.0), expect_s=200.0),
        Measure("channel", _suite("channel", quick_too=False), (  # its quick run skips 1 MiB
            Row("channel_vs_configured_echo_ratio_4KiB", "channel / gRPC configured alike, 4 KiB (host CPU)", "<= 1.3"),
            Row("channel_vs_configured_echo_ratio_1MiB", "the same, 1 MiB", "<= 1.3"),
        ), (150.0, 200.0), env={"CUDA_VISIBLE_DEVICES": ""}, expect_s=60.0),
    ]


def _last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def _rows(measure: Measure, gpu: bool, quick: bool) -> list[Row]:
    """The measure's rows on this device, one per client count where a row stands for several."""
    rows = [row for row in measure.rows if gpu or not row.gpu_only]
    return [Row(row.key.format(n=n), row.what.format(n=n), row.goal, row.gpu_only)
            for row in rows for n in (measure.counts(quick) if "{n}" in row.key else (0,))]


def run_measure(measure: Measure, device: str, quick: bool, limit_s: float) -> dict[str, Any]:
    """Run one measure's command; its exit status, seconds, the keys it printed and the rows it missed."""
    argv = [sys.executable, "-m", *measure.argv(device, quick, measure.counts(quick))]
    env = {**os.environ, **measure.env}
    start = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=limit_s, env=env)
        rc: int | str = done.returncode
        stdout, stderr = done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        rc = "timeout"
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
    keys = _last_json(stdout) or {}
    missing = [row.key for row in _rows(measure, device.startswith("cuda"), quick)
               if not isinstance(keys.get(row.key), (int, float))]
    result = {"command": " ".join(shlex.quote(a) for a in ["python", *argv[1:]]),
              "rc": rc, "s": round(time.monotonic() - start, 1), "keys": keys, "missing": missing}
    if rc != 0 or missing:
        result["stderr_tail"] = stderr[-3000:]
    return result


def card() -> str:
    """The machine the figures come from: the GPU's name, or the CPU's cores."""
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return f"{count} x {torch.cuda.get_device_name(0)}" + f", {os.cpu_count()} host cores"
    return f"CPU, {len(os.sched_getaffinity(0))} cores, torch {torch.__version__}"


def table(results: dict[str, dict[str, Any]], measures: Sequence[Measure], gpu: bool, quick: bool) -> str:
    """The rows of the measures that ran, as a markdown table."""
    lines = ["| measure | value | goal | what |", "| --- | --- | --- | --- |"]
    for measure in measures:
        result = results.get(measure.name)
        if result is None:
            continue
        for row in _rows(measure, gpu, quick):
            value = result["keys"].get(row.key)
            shown = f"{value:.3g}" if isinstance(value, float) else ("-" if value is None else str(value))
            lines.append(f"| {measure.name}: `{row.key}` | {shown} | {row.goal} | {row.what} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.table", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    names = [m.name for m in _measures(True)]
    parser.add_argument("--only", nargs="+", choices=names,
                        help="run only these measures, in this order (default: all)")
    parser.add_argument("--quick", action="store_true", help="tiny configurations: checks that every measure runs")
    parser.add_argument("--budget-s", type=float, default=0.0,
                        help="seconds for the whole run: a measure that would not fit what is left (by its time on an "
                             "H100 host) is left out, and the run fails; each runs at most what is left; 0: no budget")
    parser.add_argument("--json", action="store_true", help="end with one JSON object (always printed last)")
    parser.add_argument("--out", default="", metavar="FILE",
                        help="also write that JSON object here, rewritten after each measure (a run cut short keeps "
                             "what it measured)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    gpu = args.device.startswith("cuda")
    if gpu:
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no GPU is visible here")
    gpus = _gpu_count() if gpu else 0
    every = {m.name: m for m in _measures(gpu)}
    measures = [every[name] for name in args.only] if args.only else list(every.values())  # in the order named
    started = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    left_out: dict[str, str] = {}
    over_budget: list[str] = []  # left out for want of time: a table with holes
    the_card = card()

    def summary() -> dict[str, Any]:
        failed = sorted(name for name, r in results.items() if r["rc"] != 0 or r["missing"])
        return {"card": the_card, "device": args.device, "quick": args.quick, "left_out": left_out,
                "failed": failed, "measures": results}

    for measure in measures:
        if measure.gpus and gpus < measure.gpus:
            left_out[measure.name] = f"needs {measure.gpus} GPUs, this host has {gpus}"
            continue
        limit = measure.limit_s[0 if gpu else 1]
        if args.budget_s:
            left = args.budget_s - (time.monotonic() - started)
            expect = measure.expect_s if gpu else min(measure.expect_s * 2, limit)
            if expect > left:
                left_out[measure.name] = f"it takes about {expect:.0f} s, {left:.0f} s of the budget are left"
                over_budget.append(measure.name)
                continue
            limit = min(limit, left)
        log.info("%s ...", measure.name)
        results[measure.name] = run_measure(measure, args.device, args.quick, limit)
        result = results[measure.name]
        log.info("%s: exit %s in %.0f s%s", measure.name, result["rc"], result["s"],
                 f", missing {result['missing']}" if result["missing"] else "")
        if args.out:
            Path(args.out).write_text(json.dumps(summary(), indent=1))
    final = summary()
    print(table(results, measures, gpu, args.quick))
    for name, why in left_out.items():
        print(f"left out: {name} ({why})")
    for name in final["failed"]:
        r = results[name]
        print(f"failed: {name} (exit {r['rc']}, missing {r['missing']}):\n{r.get('stderr_tail', '')[-1500:]}")
    if args.out:
        Path(args.out).write_text(json.dumps(final, indent=1))
    print(json.dumps(final))
    return 1 if final["failed"] or over_budget else 0


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


if __name__ == "__main__":
    sys.exit(main())
