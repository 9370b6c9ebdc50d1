"""Trunk throughput with many clients: cross-client batching, and sync steps of 4 clients against 1.

Clients run in processes of their own and send precomputed activations and
gradients (their own parts' compute is left out), so the figures are those of
the trunk server: examples per second through its forward and backward, in
``sync`` mode. ``python -m bench.trunk --device cuda --config "layers=12
hidden=768 heads=12 vocab=50257 batch=4 seq=256 bf16=1" --clients 8`` is the
GPT-2-small measurement of the README.

``--replicas 2`` adds trunk replicas over torch.distributed (:mod:`splitfed.launcher`):
for each ``--clients`` count, one trunk one-at-a-time, one trunk batched, and
``--replicas`` trunks batched (one per GPU with ``--device cuda``, NCCL; CPU
processes with gloo otherwise), clients spread round robin over the replicas.
``python -m bench.trunk --device cuda --replicas 2 --clients 8 32 --config
"layers=12 hidden=768 heads=12 vocab=50257 batch=4 seq=256 bf16=1"`` gives
``replica_scaling_2gpu`` (2 GPUs / 1 GPU, batched, 32 clients).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import threading
import time
import uuid
from typing import Any

import torch

from bench import core

log = logging.getLogger("bench.trunk")


def _server(device: str, window_ms: float, replicas: int = 1) -> Any:
    from splitfed.channel.server import TrunkServer
    from splitfed.split import split_model
    from splitfed.trunk.aggregation import make_aggregator
    from splitfed.trunk.replicas import replica_aggregator
    from splitfed.trunk.runtime import TrunkRuntime
    from splitfed.trunk.store import StoreLimits

    trunk = split_model(core._gpt2().to(device), core._cuts()).trunk
    aggregator = (replica_aggregator if replicas > 1 else make_aggregator)("sync", timeout=300)
    runtime = TrunkRuntime(trunk, torch.optim.SGD(trunk.parameters(), lr=1e-4),
                           aggregator=aggregator, limits=StoreLimits(max_bytes=1 << 40),
                           autocast_dtype=torch.bfloat16 if core.SPLIT_STEP["bf16"] else None)
    return TrunkServer(runtime, insecure=True, batch_window_ms=window_ms, max_batch_tokens=1 << 22)


def _replica(rank: int, device: str, window_ms: float, replicas: int, settings: dict[str, int]) -> Any:
    """Replica ``rank``'s server (in its own process): the same trunk, on ``cuda:rank`` for a GPU run."""
    core.SPLIT_STEP.update(settings)
    return _server(f"cuda:{rank}" if device.startswith("cuda") else device, window_ms, replicas)


def _client(address: str, i: int, settings: dict[str, int], steps: int, warmup: int, joined: Any, ready: Any,
            errors: Any) -> None:
    """One client process: join, warm up, wait for the others, then ``steps`` timed sync steps."""
    from splitfed.channel.client import TrunkClient
    from splitfed.split import CutState

    try:
        torch.set_num_threads(1)
        c = settings
        tc = TrunkClient(address, insecure=True, client_id=f"bench-{i}", wire_dtype="bf16" if c["bf16"] else "fp32")
        tc.join()
        hidden = torch.randn(c["batch"], c["seq"], c["hidden"])
        grad = torch.randn(c["batch"], c["seq"], c["hidden"]) * 1e-3
        joined.wait(600)  # every client is in the step group before the first sync step
        for step in range(warmup + steps):
            if step == warmup:
                ready.wait(600)  # the whole group finished the warm-up step together
            act = uuid.uuid4().hex
            tc.forward(CutState(hidden), activation_id=act, train=True, num_examples=c["batch"])
            tc.backward(act, grad)
        tc.close()
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        errors.put(repr(exc))
        joined.abort()
        ready.abort()


def throughput(clients: int, window_ms: float, steps: int = 5, warmup: int = 2, device: str = "cpu",
               replicas: int = 1) -> float:
    """Examples per second through the trunk: ``clients`` client processes in sync mode, ``steps`` timed steps
    each (clients run in their own processes, as on their own machines), over ``replicas`` trunk replicas."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    if replicas > 1 and device.startswith("cuda"):
        device = "cuda:0"
    server = _server(device, window_ms, replicas).start()
    replica_set = None
    addresses = [server.address]
    if replicas > 1:
        from splitfed.launcher import ReplicaSet

        replica_set = ReplicaSet(server, replicas, _replica, (device, window_ms, replicas, dict(core.SPLIT_STEP)),
                                 timeout_s=600).start()
        addresses = replica_set.addresses
    joined, ready, errors = ctx.Barrier(clients), ctx.Barrier(clients + 1), ctx.Queue()
    procs = [ctx.Process(target=_client, args=(addresses[i % len(addresses)], i, dict(core.SPLIT_STEP), steps, warmup,
                                               joined, ready, errors), daemon=True) for i in range(clients)]
    try:
        for p in procs:
            p.start()
        try:
            ready.wait(600)
        except threading.BrokenBarrierError:
            pass
        start = time.perf_counter()
        for p in procs:
            p.join(1200)
        elapsed = time.perf_counter() - start
    finally:
        if replica_set is not None:
            replica_set.stop()
        server.stop(grace=0)
        for p in procs:
            if p.is_alive():
                p.kill()
    if not errors.empty():
        raise RuntimeError(f"a benchmark client failed: {errors.get()}")
    return clients * steps * core.SPLIT_STEP["batch"] / elapsed


def trunk(device: str = "cpu", clients: int = 4, window_ms: float = 50.0, repeat: int = 3) -> dict[str, float]:
    """Batched / one-at-a-time throughput with ``clients`` clients, and sync time per example N clients / 1."""
    one_at_a_time = statistics.median(throughput(clients, 0.0, device=device) for _ in range(repeat))
    log.warning("one at a time: %.1f examples/s", one_at_a_time)
    batched = statistics.median(throughput(clients, window_ms, device=device) for _ in range(repeat))
    log.warning("batched: %.1f examples/s", batched)
    single = statistics.median(throughput(1, 0.0, device=device) for _ in range(repeat))
    suffix = "" if device.startswith("cuda") else "_cpu"
    return {
        f"trunk_examples_per_s_{clients}_clients{suffix}": one_at_a_time,
        f"trunk_examples_per_s_{clients}_clients_batched{suffix}": batched,
        f"trunk_batching_speedup{suffix}": batched / one_at_a_time,
        f"sync_step_ratio_{clients}v1{suffix}": single / one_at_a_time,  # time per example, N clients / 1
    }


def replica_scaling(device: str = "cpu", clients: tuple[int, ...] = (8, 32), replicas: int = 2,
                    window_ms: float = 50.0, repeat: int = 1) -> dict[str, float]:
    """For each client count: one trunk one at a time, one trunk batched, ``replicas`` trunks batched (examples/s),
    and the scaling of the largest count (``replicas`` trunks / one, both batched)."""
    gpu = device.startswith("cuda")
    suffix = "" if gpu else "_cpu"
    out: dict[str, float] = {}
    for n in clients:
        for name, window, r in [("", 0.0, 1), ("_batched", window_ms, 1), (f"_batched_{replicas}replicas", window_ms,
                                                                          replicas)]:
            value = statistics.median(throughput(n, window, device=device, replicas=r) for _ in range(repeat))
            out[f"trunk_examples_per_s_{n}_clients{name}{suffix}"] = value
            log.warning("%d clients%s: %.1f examples/s", n, name or " one at a time", value)
    n = max(clients)
    scaling = out[f"trunk_examples_per_s_{n}_clients_batched_{replicas}replicas{suffix}"] / \
        out[f"trunk_examples_per_s_{n}_clients_batched{suffix}"]
    out[f"replica_scaling_{replicas}gpu" if gpu else f"replica_scaling_{replicas}proc_cpu"] = scaling
    return out


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trunk", description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clients", type=int, nargs="+", default=[4],
                        help="client counts (several only with --replicas)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="also measure this many trunk replicas (batched), one per GPU with --device cuda")
    parser.add_argument("--window-ms", type=float, default=50.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--config", default="", help='model and batch, e.g. "layers=12 hidden=768 heads=12 '
                        'vocab=50257 batch=4 seq=256 bf16=1" (default: the tiny GPT-2 of python -m bench)')
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    for item in args.config.split():
        key, _, value = item.partition("=")
        if key not in core.SPLIT_STEP:
            parser.error(f"--config: unknown key {key!r}; known: {', '.join(core.SPLIT_STEP)}")
        core.SPLIT_STEP[key] = int(value)
    if args.replicas > 1:
        results: dict[str, object] = dict(replica_scaling(args.device, tuple(args.clients), args.replicas,
                                                          args.window_ms, args.repeat))
    else:
        results = dict(trunk(args.device, args.clients[0], args.window_ms, args.repeat))
    results["config"] = " ".join(f"{k}={v}" for k, v in core.SPLIT_STEP.items())
    results["device"] = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    if args.json:
        print(json.dumps(results, sort_keys=True))
    else:
        for key, value in results.items():
            print(f"{key:<48} {value:.4g}" if isinstance(value, float) else f"{key:<48} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
