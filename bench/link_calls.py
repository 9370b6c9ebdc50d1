"""One call's round trip over each way a trunk server takes calls in: the socket links' figures, call by call.

A small trunk (three linear layers, hidden ``--hidden``) is served by trunk servers in processes of their own, one
per way in; one client process times evaluation forwards of ``rows x hidden`` fp32 activations against each, the
ways alternating block by block so that load from elsewhere falls on all alike, and prints the median round trip
in microseconds (and the 90th percentile):

* ``direct``: a shared-memory region's calls over the engine's direct-call socket (:mod:`splitfed.channel.transports.direct`);
* ``grpc-region``: the same region's calls over gRPC (``direct_calls=False``; the control the direct calls skip);
* ``frontend-region``: region calls through a front-end process and the engine link (small frames);
* ``frontend-socket``: the tensor's bytes through a front-end process and the engine link (large frames);
* ``bulk``: the tensor's bytes over a bulk link of 4 TCP connections beside gRPC (:mod:`splitfed.channel.transports.bulk`);
* ``socket``: the tensor's bytes streamed over gRPC (the control the bulk link skips).

The compute is a few microseconds, so the figures are those of the channel. Only ``TrunkServer``,
``TrunkClient`` and ``ChannelLimits`` are used, found where the library keeps them now or where it kept them before
the channel's sub-packages: the same command times an older checkout too (run it from that checkout's root).

    python -m bench.link_calls [--rows 256] [--hidden 256] [--calls 400] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

def _api() -> tuple[Any, Any, Any]:
    """``(TrunkServer, TrunkClient, ChannelLimits)`` of this checkout's layout."""
    try:
        from splitfed.channel.client.trunk import TrunkClient
        from splitfed.channel.server.trunkserver import TrunkServer
        from splitfed.channel.wire.limits import ChannelLimits
    except ImportError:  # the flat splitfed/channel/ of before December 2026
        from splitfed.channel.client import TrunkClient  # type: ignore[no-redef]
        from splitfed.channel.limits import ChannelLimits  # type: ignore[no-redef]
        from splitfed.channel.server import TrunkServer  # type: ignore[no-redef]
    return TrunkServer, TrunkClient, ChannelLimits


WAYS = ("direct", "grpc-region", "frontend-region", "frontend-socket", "bulk", "socket")


def _trunk(hidden: int) -> Any:
    import torch
    from torch import nn

    from splitfed.split.sequential import split_sequential

    torch.manual_seed(0)
    return split_sequential(nn.Sequential(*(nn.Linear(hidden, hidden) for _ in range(3))), 1, 2)[1]


def _server_kwargs(way: str) -> dict[str, Any]:
    return {"direct": {}, "grpc-region": {"direct_calls": False},
            "frontend-region": {"frontends": 1, "direct_calls": False}, "frontend-socket": {"frontends": 1},
            "bulk": {"bulk_connections": 4}, "socket": {}}[way]


def _client_kwargs(way: str) -> dict[str, Any]:
    socket_limits = _api()[2](stream_threshold_bytes=64 << 10)
    return {"frontend-socket": {"shared_memory": "off"},
            "bulk": {"shared_memory": "off", "bulk_connections": 4, "limits": socket_limits},
            "socket": {"shared_memory": "off", "limits": socket_limits}}.get(way, {})


def _serve(way: str, hidden: int, ready: Any, stop: Any) -> None:
    import torch

    torch.set_num_threads(1)
    server = _api()[0](_trunk(hidden), insecure=True, **_server_kwargs(way)).start()
    ready.put(server.address)
    stop.wait()
    server.stop(grace=0)


def measure(ways: list[str], rows: int, hidden: int, calls: int, blocks: int = 8) -> dict[str, dict[str, float]]:
    """Median and 90th percentile round trip (microseconds) of an evaluation forward over each way in."""
    import torch

    from splitfed.split.base import CutState

    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    procs, clients = [], {}
    try:
        for way in ways:
            ready = ctx.Queue()
            proc = ctx.Process(target=_serve, args=(way, hidden, ready, stop))  # not daemonic: front-ends are its children
            proc.start()
            procs.append(proc)
            clients[way] = _api()[1](ready.get(timeout=300), insecure=True, **_client_kwargs(way))
        state = CutState(torch.randn(rows, hidden))
        times: dict[str, list[float]] = {way: [] for way in ways}
        for client in clients.values():
            for _ in range(20):  # warm-up: regions, links, front-end connections
                client.forward(state, train=False)
        per_block = max(calls // blocks, 1)
        for _ in range(blocks):
            for way, client in clients.items():
                for _ in range(per_block):
                    t = time.perf_counter()
                    client.forward(state, train=False)
                    times[way].append(time.perf_counter() - t)
        out = {}
        for way, client in clients.items():
            ts = sorted(times[way])
            out[way] = {"median_us": statistics.median(ts) * 1e6, "p90_us": ts[int(0.9 * (len(ts) - 1))] * 1e6}
            if way == "direct":
                out[way]["went_direct"] = float(client.shared.direct_calls)
            if way == "bulk":
                out[way]["went_bulk"] = float(client.bulk.calls)
        return out
    finally:
        for client in clients.values():
            client.close()
        stop.set()
        for proc in procs:
            proc.join(20)
            if proc.is_alive():
                proc.terminate()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the comparison and print its table (``--json``: one JSON object)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--calls", type=int, default=400, help="timed calls per way")
    parser.add_argument("--ways", nargs="*", choices=WAYS, default=list(WAYS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = measure(args.ways, args.rows, args.hidden, args.calls)
    out = {"link_calls": result, "tensor_bytes": args.rows * args.hidden * 4, "cpus": os.cpu_count()}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{args.rows} x {args.hidden} fp32 ({args.rows * args.hidden * 4} bytes) each way")
        print(f"{'way':<18}{'median us':>12}{'p90 us':>12}")
        for way, r in result.items():
            print(f"{way:<18}{r['median_us']:>12.1f}{r['p90_us']:>12.1f}")
    return out


if __name__ == "__main__":
    main()
