"""Load: many concurrent clients training against one trunk server on loopback.

``python -m bench.load [--clients 32] [--steps 500] [--mode async] [--json]``: each client
thread runs forward/backward steps (a 2-layer Llama trunk, batch 2 x 16 tokens); the
trunk server runs in its own process. Prints errors, latency percentiles of a whole
step (forward + backward round trips, server compute included), throughput, the
server's peak RSS and its RSS at the end (saved forwards must not accumulate).
Exits non-zero when a client failed or the server process died.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
import uuid
from typing import Any

import torch

from bench.processes import check_alive, end_children, get_from


def _serve(port_queue: Any, stop: Any, mode: str) -> None:
    from splitfed.channel.server.trunkserver import TrunkServer
    from splitfed.split import split_model
    from splitfed.trunk.aggregation.modes import make_aggregator
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97)
    trunk = split_model(LlamaForCausalLM(cfg), (1, 3)).trunk
    server = TrunkServer(trunk, insecure=True, lr=1e-3,
                         aggregator=make_aggregator(mode, quorum=8, max_staleness=64, timeout=30)).start()
    port_queue.put(server.port)
    stop.wait()
    server.stop(grace=0)


def _rss_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def run(clients: int = 32, steps: int = 500, mode: str = "async") -> dict[str, float]:
    """Run the load; returns the figures.

    Raises:
        BenchError: the server process died (at start or during the run) or never said its port.
    """
    from splitfed.channel.client.trunk import RetryPolicy, TrunkClient
    from splitfed.split import CutState

    ctx = mp.get_context("spawn")
    port_queue, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_serve, args=(port_queue, stop, mode), daemon=True)
    proc.start()
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    try:
        address = f"127.0.0.1:{get_from(port_queue, [proc], 120, 'the trunk server process port')}"
        rss_start = _rss_kb(proc.pid, "VmRSS")
        barrier = threading.Barrier(clients)

        def client(i: int) -> None:
            c = TrunkClient(address, insecure=True, client_id=f"load-{i}", retry=RetryPolicy(timeout_s=120.0))
            mine: list[float] = []
            try:
                c.join()
                barrier.wait(timeout=120)
                for _ in range(steps):
                    hidden = torch.randn(2, 16, 32)
                    start = time.perf_counter()
                    act = uuid.uuid4().hex
                    out, _ = c.forward(CutState(hidden), activation_id=act, train=True)
                    c.backward(act, torch.ones_like(out) * 1e-3)
                    mine.append(time.perf_counter() - start)
                c.leave()
            except Exception as exc:  # counted and reported
                barrier.abort()  # the others stop waiting for this one
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")
            finally:
                c.close()
                with lock:
                    latencies.extend(mine)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        time.sleep(0.5)
        check_alive([proc], "the trunk server")
        peak = _rss_kb(proc.pid, "VmHWM")
        end = _rss_kb(proc.pid, "VmRSS")
    finally:
        stop.set()
        end_children([proc])
    lat = sorted(latencies)

    def pct(q: float) -> float:
        return lat[min(int(q * len(lat)), len(lat) - 1)] * 1e3 if lat else float("nan")

    return {"clients": clients, "steps_per_client": steps, "steps_done": len(lat), "errors": len(errors),
            "step_p50_ms": pct(0.50), "step_p99_ms": pct(0.99),
            "step_mean_ms": statistics.fmean(lat) * 1e3 if lat else float("nan"),
            "steps_per_s": len(lat) / wall, "wall_s": wall, "server_rss_start_mib": rss_start / 1024,
            "server_rss_peak_mib": peak / 1024, "server_rss_end_mib": end / 1024,
            "first_error": errors[0] if errors else ""}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--mode", default="async", choices=["sync", "async", "quorum"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.clients, args.steps, args.mode)
    result["mode"] = args.mode
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        for key, value in result.items():
            sys.stdout.write(f"{key:<22} {value:.4g}\n" if isinstance(value, float) else f"{key:<22} {value}\n")
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
