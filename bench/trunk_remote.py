"""``bench.trunk`` with the trunk server and its clients on two hosts, so that the clients do not take the
server's cores.

On the trunk's host (``--serve``: where to listen)::

    python -m bench.trunk --serve 0.0.0.0:50061 --clients 32 --device cuda \\
        --config "layers=12 hidden=768 heads=12 vocab=50257 batch=4 seq=256 bf16=1"

On the clients' host (``--connect``: the trunk's address; the same ``--clients``, ``--steps`` and ``--config``)::

    python -m bench.trunk --connect TRUNK_HOST:50061 --clients 32 \\
        --config "layers=12 hidden=768 heads=12 vocab=50257 batch=4 seq=256 bf16=1"

The clients join the trunk's step group and start once all of them are in it (each sees the group's size in its
Join reply), so no barrier crosses the hosts but the trunk's own sync steps. The server side times those steps by
the trunk's version (one per sync step): from the end of the warm-up steps to the end of the timed ones, with GPU
utilization sampled over that span, and then (unless ``--only`` leaves it out) the plain-PyTorch ceiling on its
device; it prints the keys of a batched ``bench.trunk`` run with ``"clients": "remote"``. The client side prints
the examples per second its clients saw and how many cores they used. The clients send over the socket (two hosts
share no memory). Either side exits non-zero when the run fails: a client that fails leaves the group, and the
server side fails when fewer Backwards than its clients' steps came. The channel is plaintext: use a trusted
network.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from typing import Any

from bench import core
from bench.ceiling import ceiling_keys
from bench.gpu_util import UtilSampler
from bench.trunk_clients import WAIT_S, BenchError, client_name, collect, pick_cores, run_client

#: Seconds between two reads of the trunk's version and step group while the server side waits on them.
POLL_S = 0.002


def _host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise BenchError(f"{address!r} is not HOST:PORT (e.g. 0.0.0.0:50061)")
    return host.strip("[]"), int(port)


def _wait(what: str, ready: Any, fail: Any = None) -> float:
    """Poll ``ready()`` until true (returns when, by ``time.perf_counter``); raise :class:`BenchError` when
    ``fail()`` says why (a non-empty string) or after :data:`WAIT_S`."""
    deadline = time.monotonic() + WAIT_S
    while not ready():
        why = fail() if fail is not None else ""
        if why:
            raise BenchError(why)
        if time.monotonic() > deadline:
            raise BenchError(f"{what} did not happen within {WAIT_S:.0f} s")
        time.sleep(POLL_S)
    return time.perf_counter()


def serve(address: str, clients: int, *, device: str = "cpu", window_ms: float = 50.0, steps: int = 5,
          warmup: int = 2, timeline: str = "", only: tuple[str, ...] = ("batched", "ceiling"),
          settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """Serve the bench's trunk at ``address`` to ``clients`` clients of :func:`connect` (elsewhere), time their
    ``steps`` sync steps after ``warmup``, and measure the ceiling. ``settings``: the server's (see
    :data:`bench.trunk_server.SERVER`). Raises :class:`BenchError` when they fail."""
    from bench.trunk_server import SERVER, _server
    from bench.trunk_timeline import step_figures
    from splitfed.trunk.timeline import TIMELINE, save

    SERVER.update(settings or {})  # (run as ``python -m bench.trunk``, that module is __main__, not this one)
    if SERVER["mode"] != "sync":
        raise BenchError("--serve times sync steps; run --mode async or quorum with clients on this host")
    host, port = _host_port(address)
    # A new trunk's version is 0. It is not read after start(): clients may train before start() returns (one
    # front-end takes calls in while the others start).
    start = 0
    server = _server(device, window_ms, 1, clients, host=host, port=port).start()
    runtime = server.runtime
    group = runtime.aggregator
    sampler = UtilSampler(device)
    recorded: list[dict[str, Any]] = []
    util: dict[str, Any] = {}
    try:
        print(f"bench.trunk: serving at {server.address}; waiting for {clients} clients "
              f"(python -m bench.trunk --connect HOST:{server.port} --clients {clients} ...)", file=sys.stderr,
              flush=True)
        seen = [0]  # the most members seen: a group that emptied again means the clients gave up

        def joined() -> bool:  # (or the steps began already: a front-end took calls in while the server started)
            seen[0] = max(seen[0], len(group.members))
            return seen[0] >= clients or runtime.version > start

        def left() -> str:
            return "" if group.members or not seen[0] else (
                f"the clients left after {runtime.version - start} of {warmup + steps} sync steps; see the "
                "clients' output")
        _wait(f"{clients} clients joining", joined, left)
        began = _wait("the warm-up steps", lambda: runtime.version >= start + warmup, left)
        if runtime.version > start + warmup:  # polled every POLL_S: a whole step went by unseen
            raise BenchError(f"the timed steps began before the server could time them ({runtime.version - start} "
                             "steps done already); start the clients once the server says that it serves")
        sampler.start()
        if timeline:
            TIMELINE.start(device)
        ended = _wait("the timed steps", lambda: runtime.version >= start + warmup + steps, left)
        if timeline:
            recorded = TIMELINE.stop()
        util = sampler.stop()
        _wait("the clients leaving", lambda: not group.members)
        came, due = runtime.stats["backwards"], clients * (warmup + steps)
        if came < due:  # the others went on without it
            raise BenchError(f"{came} of {due} backwards came: a client failed; see the clients' output")
    finally:  # (both stop at once when they already stopped)
        if TIMELINE.enabled:
            TIMELINE.stop()
        sampler.stop()
        server.stop(grace=0)
    n = clients
    suffix = "" if device.startswith("cuda") else "_cpu"
    elapsed = ended - began
    out: dict[str, Any] = {
        f"trunk_examples_per_s_{n}_clients_batched{suffix}": n * steps * core.SPLIT_STEP["batch"] / elapsed,
        f"trunk_requests_per_s_{n}_clients_batched{suffix}": 2 * n * steps / elapsed,
        "clients": "remote", "transport": "socket", "frontends": SERVER["frontends"], "mode": "sync"}
    if util:
        out[f"gpu_util_mean_{n}_batched{suffix}"] = util["mean"]
        out[f"gpu_util_max_{n}_batched{suffix}"] = util["max"]
        out["gpu_util_source"] = util["source"]
    if "ceiling" in only:
        out.update(ceiling_keys(device, n, steps, 3, kinds=("batched",)))
        out[f"trunk_ceiling_fraction_{n}{suffix}"] = out[f"trunk_examples_per_s_{n}_clients_batched{suffix}"] / \
            out[f"ceiling_examples_per_s_{n}_batched{suffix}"]
    if recorded:
        save(recorded, timeline)
        out.update({f"timeline_{k}": v for k, v in step_figures(recorded).items()})
    return out


def connect(address: str, clients: int, *, steps: int = 5, warmup: int = 2, client_cores: int = 0
            ) -> dict[str, Any]:
    """``clients`` client processes against the trunk of :func:`serve` at ``address``; returns what they saw.
    Raises :class:`BenchError` when one fails or dies."""
    _host_port(address)
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    cores = pick_cores(client_cores)
    procs = [ctx.Process(target=run_client, args=(address, i, dict(core.SPLIT_STEP), steps, warmup, cores, True,
                                                  events, None, None, clients), daemon=True)
             for i in range(clients)]
    try:
        for p in procs:
            p.start()
        done = collect(events, procs, "done", clients)
    except BenchError:
        for p in procs:
            p.kill()
        _leave_all(address, clients)
        raise
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    marks = [t for detail in done.values() for _, t in json.loads(detail)["marks"]]
    elapsed = max(marks) - min(marks)
    return {f"client_examples_per_s_{clients}_clients": clients * steps * core.SPLIT_STEP["batch"] / elapsed,
            "client_cores": client_cores or len(os.sched_getaffinity(0)), "clients": "remote",
            "transport": "socket"}


def _leave_all(address: str, clients: int) -> None:
    """Take every client of a failed run out of the trunk's step group (a killed process cannot leave), so that
    the server side sees the run end and fails rather than wait for them."""
    from splitfed.channel.client.trunk import RetryPolicy, TrunkClient
    from splitfed.errors import SplitFedError

    for i in range(clients):
        tc = TrunkClient(address, insecure=True, client_id=client_name(i), shared_memory="off",
                         retry=RetryPolicy(max_attempts=2, timeout_s=10))
        try:
            tc.leave()
        except SplitFedError:  # the trunk is gone too: nothing to leave
            pass
        finally:
            tc.close()
