"""The trunk server of :mod:`bench.trunk`: the GPT-2 trunk of :data:`bench.core.SPLIT_STEP`, its runtime and its
server, as the command line sets them (:data:`SERVER`), in this process or as a replica's (:mod:`splitfed.launcher`)."""

from __future__ import annotations

import sys
from typing import Any

import torch

from bench import core
from bench.trunk_clients import BenchError

#: The server's settings from the command line: ``max_batch_tokens`` (``--max-batch-tokens``, positions one
#: batched trunk call may hold), ``frontends`` (``--frontends``, front-end processes taking its calls in) and
#: ``mode`` (``--mode``, the trunk's aggregation mode: sync, async or quorum), ``compile`` (``--compile``, the
#: trunk's blocks compiled with torch.compile) and ``direct_calls`` (off with ``--no-direct``: region-carried calls
#: go over gRPC, :mod:`splitfed.channel.direct`); ``bring_early`` (``--bring-early``, :mod:`splitfed.trunk.early`);
#: ``switch_interval`` (``--switch-interval``, seconds; 0: Python's): how long a thread of the engine's process may
#: hold the interpreter lock while another waits for it (``sys.setswitchinterval``), set where the server starts.
SERVER: dict[str, Any] = {"max_batch_tokens": 1 << 22, "frontends": 0, "mode": "sync", "compile": False,
                          "direct_calls": True, "bring_early": False, "switch_interval": 0.0}

#: Modes ``--mode`` takes. ``async`` applies each contribution as it comes (staleness bounded by the client
#: count, so none is refused); ``quorum`` steps on the first half of the clients' contributions.
MODES = ("sync", "async", "quorum")


def _aggregator(replicas: int, clients: int) -> Any:
    from splitfed.trunk.aggregation import make_aggregator
    from splitfed.trunk.replicas import replica_aggregator

    mode = SERVER["mode"]
    if mode == "sync":
        return (replica_aggregator if replicas > 1 else make_aggregator)("sync", timeout=300)
    if replicas > 1:
        raise BenchError("--replicas runs the sync mode only")
    return make_aggregator(mode, quorum=max(1, clients // 2), max_staleness=max(clients, 1), timeout=300)


def _server(device: str, window_ms: float, replicas: int = 1, clients: int = 1, *, host: str = "127.0.0.1",
            port: int = 0) -> Any:
    from splitfed.channel.server import TrunkServer
    from splitfed.split import split_model
    from splitfed.trunk.runtime import TrunkRuntime
    from splitfed.trunk.store import StoreLimits

    if SERVER["switch_interval"] > 0:
        sys.setswitchinterval(SERVER["switch_interval"])
    trunk = split_model(core._gpt2().to(device), core._cuts()).trunk
    aggregator = _aggregator(replicas, clients)
    runtime = TrunkRuntime(trunk, torch.optim.SGD(trunk.parameters(), lr=1e-4),
                           aggregator=aggregator, limits=StoreLimits(max_bytes=1 << 40),
                           autocast_dtype=torch.bfloat16 if core.SPLIT_STEP["bf16"] else None,
                           compile=bool(SERVER["compile"]))
    runtime.bring_early = bool(SERVER["bring_early"])
    return TrunkServer(runtime, host=host, port=port, insecure=True, batch_window_ms=window_ms,
                       max_batch_tokens=SERVER["max_batch_tokens"], frontends=SERVER["frontends"],
                       direct_calls=bool(SERVER["direct_calls"]))


def _replica(rank: int, device: str, window_ms: float, replicas: int, settings: dict[str, int],
             server: dict[str, int]) -> Any:
    """Replica ``rank``'s server (in its own process): the same trunk, on ``cuda:rank`` for a GPU run."""
    core.SPLIT_STEP.update(settings)
    SERVER.update(server)
    return _server(f"cuda:{rank}" if device.startswith("cuda") else device, window_ms, replicas)
