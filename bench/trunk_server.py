"""The trunk server of :mod:`bench.trunk`: the GPT-2 trunk of :data:`bench.core.SPLIT_STEP`, its runtime and its
server, as the command line sets them (:data:`SERVER`), in this process, as a replica's (:mod:`splitfed.run.launcher`),
or as one of several independent engines on one device (:class:`Engines`)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time
from typing import Any

import torch

from bench import core
from bench.trunk_clients import BenchError

#: The server's settings from the command line: ``max_batch_tokens`` (``--max-batch-tokens``, positions one
#: batched trunk call may hold), ``frontends`` (``--frontends``, front-end processes taking its calls in) and
#: ``mode`` (``--mode``, the trunk's aggregation mode: sync, async or quorum), ``compile`` (``--compile``, the
#: trunk's blocks compiled with torch.compile) and ``direct_calls`` (off with ``--no-direct``: region-carried calls
#: go over gRPC, :mod:`splitfed.channel.transports.direct.server`); ``bring_early`` (``--bring-early``, :mod:`splitfed.trunk.device.early`);
#: ``switch_interval`` (``--switch-interval``, seconds; 0: Python's): how long a thread of the engine's process may
#: hold the interpreter lock while another waits for it (``sys.setswitchinterval``), set where the server starts.
SERVER: dict[str, Any] = {"max_batch_tokens": 1 << 22, "frontends": 0, "mode": "sync", "compile": False,
                          "direct_calls": True, "bring_early": False, "switch_interval": 0.0}

#: Modes ``--mode`` takes. ``async`` applies each contribution as it comes (staleness bounded by the client
#: count, so none is refused); ``quorum`` steps on the first half of the clients' contributions.
MODES = ("sync", "async", "quorum")


def _aggregator(replicas: int, clients: int) -> Any:
    from splitfed.trunk.aggregation.modes import make_aggregator
    from splitfed.trunk.replicas.group import replica_aggregator

    mode = SERVER["mode"]
    if mode == "sync":
        return (replica_aggregator if replicas > 1 else make_aggregator)("sync", timeout=300)
    if replicas > 1:
        raise BenchError("--replicas runs the sync mode only")
    return make_aggregator(mode, quorum=max(1, clients // 2), max_staleness=max(clients, 1), timeout=300)


def _server(device: str, window_ms: float, replicas: int = 1, clients: int = 1, *, host: str = "127.0.0.1",
            port: int = 0) -> Any:
    from splitfed.channel.server.trunkserver import TrunkServer
    from splitfed.split import split_model
    from splitfed.trunk.compute.runtime import TrunkRuntime
    from splitfed.trunk.compute.store import StoreLimits

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


#: Seconds an extra engine may take to build, compile and start its server.
ENGINE_START_S = 900.0


def _engine(settings: dict[str, int], server: dict[str, Any], device: str, window_ms: float, clients: int,
            addresses: Any, stop: Any, parent: int) -> None:
    """An extra engine (in a process of its own): the same trunk and settings as this process's server, serving
    until ``stop`` is set or the bench's process (``parent``) is gone."""
    core.SPLIT_STEP.update(settings)
    SERVER.update(server)
    try:
        started = _server(device, window_ms, 1, clients).start()
    except BaseException as exc:
        addresses.put(f"error: {exc!r}")
        raise
    addresses.put(started.address)
    while not stop.wait(1.0) and os.getppid() == parent:
        pass
    started.stop(grace=0)


class Engines:
    """``count - 1`` more trunk servers beside this process's, each an engine of its own (its own process, event
    loop, device thread and interpreter lock) on the same ``device``, with the same trunk and settings, and no
    gradient exchange between them: each steps over its own clients. What several engine processes per GPU
    could give at most, before the collectives that replicas add (:mod:`splitfed.trunk.replicas.group`)."""

    def __init__(self, count: int, device: str, window_ms: float, clients: int) -> None:
        ctx = mp.get_context("spawn")
        self._found, self._stop = ctx.Queue(), ctx.Event()
        self._procs = [ctx.Process(target=_engine, args=(dict(core.SPLIT_STEP), dict(SERVER), device, window_ms,
                                                         clients, self._found, self._stop, os.getpid()))
                       for _ in range(count - 1)]  # not daemons: an engine starts front-end processes of its own
        self.addresses: list[str] = []

    def start(self) -> Engines:
        """Start the engines and wait for their addresses; :class:`BenchError` if one fails or does not start."""
        for p in self._procs:
            p.start()
        deadline = time.monotonic() + ENGINE_START_S
        while len(self.addresses) < len(self._procs):
            try:
                found = self._found.get(timeout=1.0)
            except queue.Empty:
                if any(not p.is_alive() for p in self._procs) or time.monotonic() > deadline:
                    self.stop()
                    raise BenchError("an extra trunk engine died or did not start in time") from None
                continue
            if found.startswith("error:"):
                self.stop()
                raise BenchError(f"an extra trunk engine failed to start: {found[6:].strip()}")
            self.addresses.append(found)
        return self

    def stop(self) -> None:
        """Stop every engine (killed if it does not end within seconds)."""
        self._stop.set()
        for p in self._procs:
            if p.pid is not None:
                p.join(10)
                if p.is_alive():
                    p.kill()
