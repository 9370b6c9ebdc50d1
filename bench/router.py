"""What routing costs: ``python -m bench.router [--reps N] [--seconds S] [--clients C] [--no-nginx] [--json FILE]``.

A trunk server (one linear layer: the channel is what is measured) runs in a process of its own, with two ways to
reach it through one more hop: today's Python router (a process of its own) and nginx (``splitfed route --proxy
nginx``'s configuration, nginx's own worker processes; left out when nginx is not installed or with ``--no-nginx``).
This process is the client. For evaluation forwards of 4 KiB and 1 MiB and for a training split step (a forward and
its backward) of 1 MiB it calls the server directly, through the router and through nginx, address by address in
turn (so load from elsewhere falls on all three alike), and prints the median round trip of each and the ratios to
direct. Then ``--clients`` client threads send forwards as fast as they can for ``--seconds`` to each address in
turn, and the calls per second of each and their ratios to direct are printed. Tensors travel over the socket (shared
memory off), a proxy's worst case. Exits non-zero when a call fails.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

SIZES = (4 << 10, 1 << 20)
STEP_BYTES = 1 << 20
HIDDEN = 256


def _linear_trunk() -> Any:
    """One linear layer over the cut's hidden state (a trunk with a parameter, so a split step updates it)."""
    from dataclasses import replace

    from torch import nn

    class LinearTrunk(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(HIDDEN, HIDDEN)

        def forward(self, state: Any) -> Any:
            return replace(state, hidden=self.linear(state.hidden))

    return LinearTrunk()


def _serve(kind: str, target: str, ready: Any, stop: Any) -> None:
    """A trunk server (``kind`` = "trunk") or a router in front of ``target``, until ``stop`` is set."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    if kind == "trunk":
        import torch

        from splitfed.channel.server.trunkserver import TrunkServer
        from splitfed.trunk.aggregation.modes import make_aggregator

        torch.set_num_threads(1)
        server: Any = TrunkServer(_linear_trunk(), insecure=True, shared_memory_bytes=0,
                                  aggregator=make_aggregator("async"), model_name="bench").start()
    else:
        from splitfed.channel.routing import Router

        server = Router([target], insecure=True).start()
    ready.put(server.address)
    stop.wait()
    server.stop(grace=0)


def _state(nbytes: int) -> Any:
    import torch

    from splitfed.split import CutState

    return CutState(torch.randn(max(nbytes // 4 // HIDDEN, 1), HIDDEN))


def _call(client: Any, state: Any, step: bool) -> None:
    import torch

    if not step:
        client.forward(state, train=False)
        return
    act = uuid.uuid4().hex
    out, _ = client.forward(state, activation_id=act, train=True)
    client.backward(act, torch.zeros_like(out))  # a step that leaves the weights as they are


def latency_ms(addresses: list[str], nbytes: int, reps: int, step: bool = False) -> list[float]:
    """Median milliseconds of one evaluation forward (``step``: a training forward and its backward) of ``nbytes``
    to each address, the addresses taking turns call by call."""
    from splitfed.channel.client.trunk import TrunkClient

    clients = [TrunkClient(a, insecure=True, shared_memory="off") for a in addresses]
    state = _state(nbytes)
    times: list[list[float]] = [[] for _ in addresses]
    try:
        for client in clients:
            _call(client, state, step)  # connect outside the timing
        for _ in range(reps):
            for client, kept in zip(clients, times):
                start = time.perf_counter()
                _call(client, state, step)
                kept.append(time.perf_counter() - start)
    finally:
        for client in clients:
            client.close()
    return [statistics.median(t) * 1000 for t in times]


def calls_per_s(address: str, nbytes: int, clients: int, seconds: float) -> float:
    """Forwards per second that ``clients`` threads (a client each) complete against ``address``."""
    from splitfed.channel.client.trunk import TrunkClient

    state = _state(nbytes)
    conns = [TrunkClient(address, insecure=True, shared_memory="off", client_id=f"bench-{i}") for i in range(clients)]
    for c in conns:
        c.forward(state, train=False)
    counts = [0] * clients
    errors: list[BaseException] = []
    deadline = time.perf_counter() + seconds

    def run(i: int) -> None:
        try:
            while time.perf_counter() < deadline:
                conns[i].forward(state, train=False)
                counts[i] += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    start = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    for c in conns:
        c.close()
    if errors:
        raise errors[0]
    return sum(counts) / elapsed


def _nginx(direct: str, workers: str) -> Any:
    """nginx in front of ``direct`` (``splitfed route --proxy nginx``'s configuration), or None: not installed."""
    from splitfed.channel.routing.discovery import discover
    from splitfed.channel.routing.nginx import NginxProxy, NginxSettings
    from splitfed.errors import ConfigError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        return NginxProxy(NginxSettings(port=port, workers=workers), discover([direct]),
                          Path(tempfile.mkdtemp(prefix="bench-nginx-"))).start()
    except ConfigError as exc:
        print(f"nginx left out: {exc}")
        return None


def _ratios(values: list[float]) -> list[float]:
    return [v / values[0] for v in values[1:]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=200, help="calls per row and address for the latency")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per size and address for the throughput")
    parser.add_argument("--clients", type=int, default=4, help="client threads for the throughput")
    parser.add_argument("--nginx-workers", default="1", help="nginx worker processes (the router is one process)")
    parser.add_argument("--no-nginx", action="store_true", help="leave nginx out")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    stop, ready = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_serve, args=("trunk", "", ready, stop), daemon=True)]
    procs[0].start()
    direct = ready.get(timeout=120)
    procs.append(ctx.Process(target=_serve, args=("router", direct, ready, stop), daemon=True))
    procs[1].start()
    routed = ready.get(timeout=120)
    nginx = None if args.no_nginx else _nginx(direct, args.nginx_workers)
    names = ["direct", "router"] + (["nginx"] if nginx is not None else [])
    addresses = [direct, routed] + ([nginx.address] if nginx is not None else [])
    results: dict[str, Any] = {"latency": [], "step": [], "throughput": []}
    head = "".join(f"{n + ' ms':>11}" for n in names) + "".join(f"{n + ' / direct':>16}" for n in names[1:])
    try:
        print(f"median round trip ({args.reps} calls each, alternating):")
        print(f"{'call':>22}{head}")
        rows = [(f"forward {n >> 10} KiB", n, False) for n in SIZES] + [(f"split step {STEP_BYTES >> 20} MiB",
                                                                          STEP_BYTES, True)]
        for label, nbytes, step in rows:
            ms = latency_ms(addresses, nbytes, args.reps, step)
            row = {"call": "step" if step else "forward", "bytes": nbytes, "direct_ms": ms[0], "router_ms": ms[1],
                   "ratio": ms[1] / ms[0]}
            if nginx is not None:
                row.update(nginx_ms=ms[2], nginx_ratio=ms[2] / ms[0])
            results["step" if step else "latency"].append(row)
            print(f"{label:>22}" + "".join(f"{v:>11.2f}" for v in ms) + "".join(f"{r:>16.2f}" for r in _ratios(ms)))
        print(f"\n{args.clients} clients at once, forwards per second:")
        print(f"{'call':>22}" + "".join(f"{n:>11}" for n in names) + "".join(f"{n + ' / direct':>16}"
                                                                            for n in names[1:]))
        for nbytes in SIZES:
            rates = [calls_per_s(a, nbytes, args.clients, args.seconds) for a in addresses]
            row = {"bytes": nbytes, "direct_per_s": rates[0], "router_per_s": rates[1], "ratio": rates[1] / rates[0]}
            if nginx is not None:
                row.update(nginx_per_s=rates[2], nginx_ratio=rates[2] / rates[0])
            results["throughput"].append(row)
            print(f"{'forward ' + str(nbytes >> 10) + ' KiB':>22}" + "".join(f"{v:>11.1f}" for v in rates)
                  + "".join(f"{r:>16.2f}" for r in _ratios(rates)))
    finally:
        if nginx is not None:
            nginx.stop(grace=0)
        stop.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
