"""What the router costs: ``python -m bench.router [--reps N] [--seconds S] [--clients C] [--json FILE]``.

A trunk server (an identity trunk: only the channel is measured) and a router in front of it run in processes of
their own. This process is the client: for activations of 4 KiB and 1 MiB it sends evaluation forwards to the
server directly and through the router, alternating call by call (so load from elsewhere falls on both alike), and
prints the median round trip of each, the router's added milliseconds and the ratio router / direct. Then
``--clients`` client threads send forwards as fast as they can for ``--seconds`` to each address in turn, and the
calls per second of each and their ratio are printed. Tensors travel over the socket (shared memory off), the
router's worst case. Exits non-zero when a call fails.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

SIZES = (4 << 10, 1 << 20)
HIDDEN = 256


def _serve(kind: str, target: str, ready: Any, stop: Any) -> None:
    """A trunk server (``kind`` = "trunk") or a router in front of ``target``, until ``stop`` is set."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    if kind == "trunk":
        from torch import nn

        from splitfed.channel.server.trunkserver import TrunkServer

        server: Any = TrunkServer(nn.Identity(), insecure=True, shared_memory_bytes=0).start()
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


def latency_ms(direct: str, routed: str, nbytes: int, reps: int) -> tuple[float, float]:
    """Median milliseconds of one evaluation forward of ``nbytes``, directly and through the router."""
    from splitfed.channel.client.trunk import TrunkClient

    clients = [TrunkClient(a, insecure=True, shared_memory="off") for a in (direct, routed)]
    state = _state(nbytes)
    times: tuple[list[float], list[float]] = ([], [])
    try:
        for client in clients:
            client.forward(state, train=False)  # connect outside the timing
        for _ in range(reps):
            for client, kept in zip(clients, times):
                start = time.perf_counter()
                client.forward(state, train=False)
                kept.append(time.perf_counter() - start)
    finally:
        for client in clients:
            client.close()
    return statistics.median(times[0]) * 1000, statistics.median(times[1]) * 1000


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=200, help="forwards per size and address for the latency")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per size and address for the throughput")
    parser.add_argument("--clients", type=int, default=4, help="client threads for the throughput")
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
    results: dict[str, Any] = {"latency": [], "throughput": []}
    try:
        print(f"{'activation':>10} {'direct ms':>10} {'router ms':>10} {'added ms':>9} {'router / direct':>16}")
        for nbytes in SIZES:
            d, r = latency_ms(direct, routed, nbytes, args.reps)
            results["latency"].append({"bytes": nbytes, "direct_ms": d, "router_ms": r, "ratio": r / d})
            print(f"{nbytes >> 10:>6} KiB {d:>10.2f} {r:>10.2f} {r - d:>9.2f} {r / d:>16.2f}")
        print(f"\n{args.clients} clients at once, forwards per second:")
        print(f"{'activation':>10} {'direct':>10} {'router':>10} {'router / direct':>16}")
        for nbytes in SIZES:
            d = calls_per_s(direct, nbytes, args.clients, args.seconds)
            r = calls_per_s(routed, nbytes, args.clients, args.seconds)
            results["throughput"].append({"bytes": nbytes, "direct_per_s": d, "router_per_s": r, "ratio": r / d})
            print(f"{nbytes >> 10:>6} KiB {d:>10.1f} {r:>10.1f} {r / d:>16.2f}")
    finally:
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
