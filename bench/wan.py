"""Split training steps over a bandwidth-shaped link between two network namespaces.

``python -m bench.wan`` creates two network namespaces joined by a veth pair,
shapes both ends with a ``tc`` token bucket (``tbf``) to each rate, starts a
trunk server as its own process in one namespace and a client process in the
other, and measures, per model, wire compression and rate: the split training
step time (median over ``--steps`` steps after ``--warmup``) and the bytes per
step (the channel's tensor payload, and everything the client's veth carried:
gRPC, HTTP/2, TCP and IP included). The settings are interleaved step by step
so that machine noise hits them alike. ``tbf`` shapes bandwidth only: the
namespaces add no latency (``netem`` is not available everywhere), so a real
WAN's round-trip time comes on top of these numbers.

Needs root, ``ip netns`` and ``tc`` with ``tbf``. Exit codes: 0 done, 1 a
process of the benchmark failed, 2 bad arguments, 77 cannot run here (not
root, no ``ip``/``tc``, namespaces or ``tbf`` refused; the reason goes to
stderr), 130 interrupted (Ctrl-C), 143 and 129 on SIGTERM and SIGHUP. Namespaces and processes are removed on every exit (SIGTERM and
SIGINT included); namespaces left by a killed run (``sfwan<pid>s``/``c``) are
removed by the next run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.netns import SERVER_IP, CannotRun, link, parse_rate

SKIP_EXIT = 77
TRUNK_PORT, SINK_PORT = 50051, 50052
MODELS = ("tiny-gpt2", "mnist-cnn")
COMPRESSIONS = ("none", "int8", "topk")
RATES = ("100mbit", "1gbit")
#: Cut points; the tiny GPT-2 is the split-step benchmark's (6 layers, hidden 256, vocab 8192).
CUTS = {"tiny-gpt2": (2, 4), "mnist-cnn": (3, 6)}
#: Batch per model (full, ``--quick``): GPT-2 (batch, seq); the CNN images of the main job's batch.
BATCH = {"tiny-gpt2": ((8, 128), (2, 16)), "mnist-cnn": ((32,), (4,))}
GRPC_OPTIONS = [("grpc.enable_http_proxy", 0)]


# -- the workload (both processes build the same model) -------------------------------------
def build_model(name: str) -> torch.nn.Module:
    """The benchmark's model ``name``, seeded, in training mode."""
    torch.manual_seed(0)
    if name == "mnist-cnn":
        from splitfed.models.catalog import mnist_cnn

        return mnist_cnn().train()
    from transformers import GPT2LMHeadModel

    from splitfed.models.catalog import tiny_gpt2_config

    return GPT2LMHeadModel(tiny_gpt2_config(8192, layers=6, hidden=256, heads=4, positions=128)).train()


def make_batch(name: str, quick: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs and labels of the model's batch shape (sizes on the wire do not depend on the values)."""
    gen = torch.Generator().manual_seed(1)
    shape = BATCH[name][1 if quick else 0]
    if name == "mnist-cnn":
        return torch.randn(shape[0], 1, 28, 28, generator=gen), torch.randint(0, 10, shape, generator=gen)
    ids = torch.randint(0, 8192, shape, generator=gen)
    return ids, ids


# -- inside the server namespace ------------------------------------------------------------
def _sink(port: int) -> None:
    """Accept connections, read each to its end, answer one byte: the link-throughput probe's far end."""
    listener = socket.create_server((SERVER_IP, port))
    while True:
        conn, _ = listener.accept()
        with conn:
            while conn.recv(1 << 20):
                pass
            conn.sendall(b"k")


def serve(model: str) -> int:
    """Serve the model's trunk on the server namespace's address until SIGTERM."""
    from splitfed.channel.server.trunkserver import TrunkServer
    from splitfed.split import split_model
    from splitfed.trunk.aggregation.modes import make_aggregator

    trunk = split_model(build_model(model), CUTS[model]).trunk
    # One client process steps its settings' clients in turn, each forward then backward: async mode steps
    # the trunk on every gradient, as sync mode does for a lone client (sync would wait for the others).
    server = TrunkServer(trunk, host=SERVER_IP, port=TRUNK_PORT, insecure=True, lr=1e-3,
                         aggregator=make_aggregator("async")).start()
    threading.Thread(target=_sink, args=(SINK_PORT,), daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    sys.stdout.write(f"READY {server.port}\n")
    sys.stdout.flush()
    stop.wait()
    server.stop(grace=0)
    return 0


# -- inside the client namespace ------------------------------------------------------------
def _link_bytes(dev: str) -> int:
    stats = Path("/sys/class/net") / dev / "statistics"
    return int((stats / "tx_bytes").read_text()) + int((stats / "rx_bytes").read_text())


def _throughput(rate_bps: float | None, seconds: float) -> float:
    """MB/s of one TCP stream to the server's sink, sending about ``seconds`` worth at the rate."""
    size = int(min(rate_bps / 8 * seconds if rate_bps else 256e6 * seconds, 256e6))
    block = b"\0" * (1 << 20)
    with socket.create_connection((SERVER_IP, SINK_PORT), timeout=60) as conn:
        start = time.perf_counter()
        for _ in range(max(size // len(block), 1)):
            conn.sendall(block)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)
        elapsed = time.perf_counter() - start
    return max(size // len(block), 1) * len(block) / elapsed / 1e6


def _label(compression: str, micro_batches: int) -> str:
    return compression if micro_batches == 1 else f"{compression} mb{micro_batches}"


def client(model: str, compressions: Sequence[str], dev: str, rate_bps: float | None, steps: int, warmup: int,
           quick: bool, micro_batches: Sequence[int] = (1,)) -> dict[str, Any]:
    """Time split steps against the trunk server, the settings (compression x micro-batches) interleaved step by
    step."""
    from splitfed.channel.client.remote import RemoteTrunk
    from splitfed.codec.compression import WireCompression
    from splitfed.split import SplitModel, split_model

    x, y = make_batch(model, quick)
    runs: list[tuple[str, Callable[[], None], Any]] = []
    settings = [(name, k) for name in compressions for k in micro_batches]
    for name, k in settings:
        parts = split_model(build_model(model), CUTS[model])
        remote = RemoteTrunk(f"{SERVER_IP}:{TRUNK_PORT}", insecure=True, options=GRPC_OPTIONS,
                             wire_compression=WireCompression.of(name), channels=min(k, 4), max_in_flight=2 * k)
        split = SplitModel(parts.bottom, remote, parts.top, task=parts.task, config=parts.config, micro_batches=k)
        opt = torch.optim.SGD(parts.client_modules().parameters(), lr=1e-3)

        def step(split: SplitModel = split, opt: torch.optim.Optimizer = opt) -> None:
            split(x, labels=y).loss.backward()
            opt.step()
            opt.zero_grad()
        runs.append((_label(name, k), step, remote))
    link_mb_s = _throughput(rate_bps, 0.25 if quick else 1.0)
    for _ in range(warmup):
        for _, step, _ in runs:
            step()
    labels = [_label(name, k) for name, k in settings]
    times: dict[str, list[float]] = {name: [] for name in labels}
    payload = dict.fromkeys(labels, 0)
    link = dict.fromkeys(labels, 0)
    for _ in range(steps):
        for name, step, remote in runs:
            counted, wire = remote.client.bytes_sent + remote.client.bytes_received, _link_bytes(dev)
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
            link[name] += _link_bytes(dev) - wire
            payload[name] += remote.client.bytes_sent + remote.client.bytes_received - counted
    for _, _, remote in runs:
        remote.close()
    return {"link_mb_s": link_mb_s, "settings": [
        {"compression": name, "micro_batches": k, "setting": label, "step_ms": statistics.median(times[label]) * 1e3,
         "step_ms_all": [round(t * 1e3, 2) for t in times[label]],
         "payload_bytes_per_step": payload[label] / steps, "link_bytes_per_step": link[label] / steps}
        for (name, k), label in zip(settings, labels)]}


# -- in the calling namespace: processes -------------------------------------------------------
def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return env


def _wait_ready(proc: subprocess.Popen[str], timeout: float) -> None:
    """Wait for the server's READY line: at most ``timeout`` seconds, and no longer than the server lives."""
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()  # type: ignore
    deadline = time.monotonic() + timeout
    line = ""
    while not line and time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:  # it ended: one last look at what it wrote
                try:
                    line = lines.get(timeout=0.5)
                except queue.Empty:
                    break
    if not line.startswith("READY"):
        raise RuntimeError(f"the trunk server did not start (exit code {proc.poll()})")


def measure(models: Sequence[str], compressions: Sequence[str], rates: Sequence[str], steps: int, warmup: int,
            threads: int, quick: bool, log: Callable[[str], None], micro_batches: Sequence[int] = (1,)
            ) -> dict[str, Any]:
    """Run the benchmark; returns the JSON-able results (see the module docstring)."""
    env, results = _child_env(), []
    with link() as pair, tempfile.TemporaryDirectory(prefix="sfwan") as tmp:
        for model in models:
            server_log = Path(tmp) / f"server-{model}.log"
            with open(server_log, "w") as err:
                argv = [sys.executable, "-m", "bench.wan", "--role", "serve", "--models", model, "--threads",
                        str(threads)]
                server = pair.spawn(pair.server, argv, stdout=subprocess.PIPE, stderr=err, env=env)
            try:
                _wait_ready(server, 180)
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}: {server_log.read_text()[-2000:]}") from None
            for rate in rates:
                rate_bps = parse_rate(rate)
                pair.shape(rate_bps)
                log(f"{model} at {rate}: {warmup} warm-up and {steps} measured steps per setting")
                argv = [sys.executable, "-m", "bench.wan", "--role", "client", "--models", model,
                        "--compression", ",".join(compressions), "--dev", pair.devs[pair.client], "--rate-bps",
                        str(rate_bps or 0), "--steps", str(steps), "--warmup", str(warmup),
                        "--threads", str(threads), "--micro-batches", ",".join(map(str, micro_batches))
                        ] + (["--quick"] * quick)
                proc = pair.spawn(pair.client, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
                try:
                    out, err_text = proc.communicate(timeout=1800)
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"the client of {model} at {rate} ran past 30 minutes") from None
                if proc.returncode != 0:
                    raise RuntimeError(f"the client of {model} at {rate} failed: {err_text[-2000:]}")
                if server.poll() is not None:
                    raise RuntimeError(f"the trunk server of {model} ended with exit code {server.returncode} "
                                       f"during the run at {rate}: {server_log.read_text()[-2000:]}")
                measured = json.loads(out.strip().splitlines()[-1])
                for setting in measured["settings"]:
                    results.append({"model": model, "rate": rate, "rate_bps": rate_bps,
                                    "link_mb_s": measured["link_mb_s"], **setting})
            server.terminate()
            server.wait(30)
        namespaces = [pair.server, pair.client]
    return {"steps": steps, "warmup": warmup, "threads": threads, "quick": quick, "namespaces": namespaces,
            "namespaces_left": pair.exists(), "results": results,
            "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                        "kernel": platform.release()}}


# -- report ------------------------------------------------------------------------------------
def table(report: dict[str, Any]) -> str:
    """A Markdown table of the results, with each setting's step time relative to ``none`` at its rate."""
    header = ("| model | rate | link MB/s | compression | micro-batches | step ms (median) | vs none | MB per step on "
              "the link | payload MB per step | link MB / link MB/s, ms |")
    rows = [header, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    base = {(r["model"], r["rate"]): r["step_ms"] for r in report["results"]
            if r["compression"] == "none" and r.get("micro_batches", 1) == 1}
    for r in report["results"]:
        ref = base.get((r["model"], r["rate"]))
        ratio = f"{r['step_ms'] / ref:.2f}" if ref else "-"
        rows.append(f"| {r['model']} | {r['rate']} | {r['link_mb_s']:.1f} | {r['compression']} "
                    f"| {r.get('micro_batches', 1)} | {r['step_ms']:.0f} "
                    f"| {ratio} | {r['link_bytes_per_step'] / 1e6:.3f} | {r['payload_bytes_per_step'] / 1e6:.3f} "
                    f"| {r['link_bytes_per_step'] / r['link_mb_s'] / 1e3:.0f} |")
    return "\n".join(rows)


def plot(report: dict[str, Any], path: Path) -> None:
    """Step time per rate and compression (top) and MB per step (bottom), one column per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report["results"]
    models = list(dict.fromkeys(r["model"] for r in res))
    rates = list(dict.fromkeys(r["rate"] for r in res))
    comps = list(dict.fromkeys(r.get("setting", r["compression"]) for r in res))
    fig, axes = plt.subplots(2, len(models), figsize=(5.5 * len(models), 7), squeeze=False)
    width = 0.8 / len(comps)
    for col, model in enumerate(models):
        get = {(r["rate"], r.get("setting", r["compression"])): r for r in res if r["model"] == model}
        for i, comp in enumerate(comps):
            xs = [j + (i - (len(comps) - 1) / 2) * width for j in range(len(rates))]
            axes[0][col].bar(xs, [get[(rate, comp)]["step_ms"] for rate in rates], width, label=comp)
            axes[1][col].bar(i, get[(rates[0], comp)]["link_bytes_per_step"] / 1e6, 0.6, label=comp)
        axes[0][col].set_xticks(range(len(rates)), rates)
        axes[0][col].set_ylabel("split step, ms (median)")
        axes[0][col].set_title(model)
        axes[0][col].legend(title="wire compression")
        axes[1][col].set_xticks(range(len(comps)), comps)
        axes[1][col].set_ylabel("MB per step on the link")
        axes[1][col].set_title(f"bytes per step ({rates[0]}; about the same at every rate)", fontsize=9)
    fig.suptitle("Split training step over a tbf-shaped veth link (no added latency; median of "
                 f"{report['steps']} steps, shared {report['machine']['cpus']}-core machine)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _csv(text: str, allowed: Sequence[str] | None = None) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if allowed is not None and s not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(allowed or ['rates'])}")
    return items


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m bench.wan`` (and of its server and client processes)."""
    parser = argparse.ArgumentParser(prog="python -m bench.wan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=lambda s: _csv(s, MODELS), default=list(MODELS))
    parser.add_argument("--compression", type=lambda s: _csv(s, COMPRESSIONS), default=list(COMPRESSIONS))
    parser.add_argument("--rates", type=_csv, default=list(RATES), help="e.g. 100mbit,1gbit,unshaped")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per setting")
    parser.add_argument("--warmup", type=int, default=2, help="steps per setting before measuring")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server and of the client "
                        "(1: one core each; more threads than cores slow both down)")
    parser.add_argument("--micro-batches", type=lambda s: [int(v) for v in _csv(s)], default=[1],
                        help="micro-batches per step to compare, e.g. 1,4 (pipelined split step)")
    parser.add_argument("--quick", action="store_true", help="tiny batches (for tests)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--plot", type=Path, help="write a PNG of the results here (e.g. docs/wan.png)")
    parser.add_argument("--role", choices=["main", "serve", "client"], default="main", help=argparse.SUPPRESS)
    parser.add_argument("--dev", help=argparse.SUPPRESS)
    parser.add_argument("--rate-bps", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        for rate in args.rates:
            parse_rate(rate)
    except ValueError as exc:
        parser.error(str(exc))
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    torch.set_num_threads(args.threads)
    if args.role == "serve":
        return serve(args.models[0])
    if args.role == "client":
        result = client(args.models[0], args.compression, args.dev, args.rate_bps or None, args.steps, args.warmup,
                        args.quick, args.micro_batches)
        sys.stdout.write(json.dumps(result) + "\n")
        return 0
    try:
        report = measure(args.models, args.compression, args.rates, args.steps, args.warmup, args.threads, args.quick,
                         lambda line: print(f"bench.wan: {line}", file=sys.stderr, flush=True), args.micro_batches)
    except CannotRun as exc:
        print(f"bench.wan: skipped, cannot run here: {exc}", file=sys.stderr)
        return SKIP_EXIT
    except RuntimeError as exc:
        print(f"bench.wan: failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench.wan: interrupted; namespaces and processes removed", file=sys.stderr)
        return 130
    if args.plot is not None:
        plot(report, args.plot)
    print(json.dumps(report, indent=1) if args.json else table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
