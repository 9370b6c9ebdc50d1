"""Trunk throughput with many clients, against what the same device does in plain PyTorch.

Clients run in processes of their own and send precomputed activations and gradients (their own parts' compute is
left out), so the figures are those of the trunk server: examples per second through its forward and backward, in
``sync`` mode, over shared memory (``--socket``: over the socket, as clients on other hosts). In the same run and on
the same device, :mod:`bench.ceiling` measures the plain-PyTorch trunk step over the same rows (batched: one
forward and backward over every client's rows; sequential: client after client), so ``trunk_ceiling_fraction_<N>``
= server batched / ceiling batched. GPU utilization is sampled while the server runs (:mod:`bench.gpu_util`), and
while the ceiling runs (``ceiling_gpu_util_mean_<N>_batched``): how busy plain PyTorch keeps the same GPU.

``python -m bench.trunk --device cuda --clients 32 --config "layers=12 hidden=768 heads=12 vocab=50257 batch=4
seq=256 bf16=1"`` is the GPT-2-small measurement of the README. ``--timeline FILE`` records the server's timeline
(:mod:`splitfed.trunk.timeline`) over the batched run's timed steps, writes it as JSON and prints the figures of
its median sync step (on a GPU also the engine's reads of the GPU a step, ``timeline_host_syncs_per_step``:
:mod:`bench.host_syncs`). ``--client-cores K`` pins the client processes to the last K cores and the server (its
threads and front-end processes) to the others; the output says how many cores each side used (``client_cores``,
``server_cores``).

``--replicas 2`` adds trunk replicas over torch.distributed (:mod:`splitfed.run.launcher`): for each ``--clients``
count, one trunk one-at-a-time, one trunk batched, and ``--replicas`` trunks batched (one per GPU with ``--device
cuda``, NCCL; CPU processes with gloo otherwise), clients spread round robin over the replicas:
``replica_scaling_2gpu`` (2 GPUs / 1 GPU, batched, 32 clients). ``--engines 2`` does the same with independent
engines on the one device (:class:`bench.trunk_server.Engines`: each its own process and clients, no gradient
exchange): ``engine_scaling_2``, the most that several engine processes per GPU could give.

Every wait on a client process is bounded and checks that the processes are alive: a client that dies or fails
ends the benchmark with a non-zero exit.

``--compile`` compiles the server's trunk blocks with torch.compile (``splitfed serve --compile``) and adds, in
the same run, the ceiling with the same compiled blocks (``trunk_ceiling_fraction_<N>_vs_compiled``).
``--serve HOST:PORT`` and ``--connect HOST:PORT`` run the server and its clients on two hosts
(:mod:`bench.trunk_remote`). ``--inject loop=100 client=500`` runs the batched throughput again with each named
part slowed by that many microseconds, and reports how much of each delay a sync step shows (:mod:`bench.inject`).
``--switch-interval 0.0005`` sets the engine's interpreter switch interval (``sys.setswitchinterval``, Python's
5 ms by default; ``switch_interval_s`` in the output).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from bench import core, trunk_remote
from bench.ceiling import ceiling_keys
from bench.cpu_use import ENGINE_THREADS, CpuUse, cpu_figures, process_groups
from bench.gpu_util import UtilSampler
from bench.host_syncs import HostSyncs
from bench.inject import PARTS, InjectError, causal, parse
from bench.trunk_clients import (
    BenchError,
    client_name,
    collect,
    keep_server_off_client_cores,
    pick_cores,
    run_client,
)
from bench.trunk_server import MODES, SERVER, Engines, _replica, _server
from bench.trunk_timeline import step_figures
from splitfed.errors import SplitFedError

log = logging.getLogger("bench.trunk")

@dataclass
class Run:
    """One throughput run's figures."""

    examples_per_s: float
    requests_per_s: float
    seconds: float
    gpu_util: dict[str, Any] = field(default_factory=dict)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)
    #: The engine's reads of the GPU over the timed steps (recorded with the timeline, on a GPU).
    host_syncs: int = 0


def throughput(clients: int, window_ms: float, steps: int = 5, warmup: int = 2, device: str = "cpu",
               replicas: int = 1, *, client_cores: int = 0, socket: bool = False, timeline: bool = False,
               engines: int = 1) -> Run:
    """``clients`` client processes, ``steps`` timed steps each (in the mode of ``SERVER``, sync by default), over
    ``replicas`` trunk replicas, or over ``engines`` independent engines on the one device (:class:`Engines`).

    Raises :class:`BenchError` when a client fails or dies, or the run stalls.
    """
    import multiprocessing as mp

    from splitfed.trunk.timeline import TIMELINE

    ctx = mp.get_context("spawn")
    if replicas > 1 and device.startswith("cuda"):
        device = "cuda:0"
    server = _server(device, window_ms, replicas, clients).start()
    replica_set = None
    addresses = [server.address]
    if replicas > 1:
        from splitfed.run.launcher import ReplicaSet

        replica_set = ReplicaSet(server, replicas, _replica, (device, window_ms, replicas, dict(core.SPLIT_STEP),
                                                                  dict(SERVER)),
                                 timeout_s=600).start()
        addresses = replica_set.addresses
    extra = None
    if engines > 1:
        try:
            extra = Engines(engines, device, window_ms, clients // engines).start()
        except BenchError:
            server.stop(grace=0)
            raise
        addresses += extra.addresses
    events, start, go = ctx.Queue(), ctx.Event(), ctx.Event()
    cores = pick_cores(client_cores)
    procs = [ctx.Process(target=run_client, args=(addresses[i % len(addresses)], i, dict(core.SPLIT_STEP), steps,
                                                  warmup, cores, socket, events, go, start), daemon=True)
             for i in range(clients)]
    sampler, syncs = UtilSampler(device), HostSyncs(frames=9)
    try:
        for p in procs:
            p.start()
        collect(events, procs, "joined", clients)
        start.set()
        collect(events, procs, "warm", clients)
        sampler.start()
        cpu = CpuUse(process_groups(server, procs), ENGINE_THREADS).start()
        if timeline:
            TIMELINE.start(device)
            syncs.start()
        began = time.perf_counter()
        go.set()
        done = collect(events, procs, "done", clients)
        elapsed = time.perf_counter() - began
        cpu_use = cpu.stop(elapsed, clients=sum(json.loads(d)["cpu_s"] for d in done.values()))
        if cpu_use:  # this engine's calls: its clients' (round robin over the replicas) Forward and Backward a step
            calls = 2 * steps * len(range(0, clients, len(addresses)))
            cpu_use["engine-loop_us_per_call"] = cpu_use["engine-loop_cores"] * elapsed / calls * 1e6
    finally:
        recorded = TIMELINE.stop() if timeline else []
        host_syncs = syncs.stop()
        origin = TIMELINE.origin
        util = sampler.stop()
        if replica_set is not None:
            replica_set.stop()
        if extra is not None:
            extra.stop()
        server.stop(grace=0)
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    if recorded:  # the clients' own marks, on the server's timeline
        for i, detail in done.items():
            recorded += [{"t": t - origin, "kind": kind, "client": client_name(i), "thread": "client"}
                         for kind, t in json.loads(detail)["marks"]]
        recorded.sort(key=lambda e: e["t"])
    examples = clients * steps * core.SPLIT_STEP["batch"]
    return Run(examples / elapsed, 2 * clients * steps / elapsed, elapsed, util, recorded, cpu_use, host_syncs)


#: The runs :func:`trunk` makes; ``--only`` picks some.
RUNS = ("one", "batched", "single", "ceiling")


def trunk(device: str = "cpu", clients: int = 4, window_ms: float = 50.0, repeat: int = 3, steps: int = 5,
          client_cores: int = 0, socket: bool = False, timeline: str = "", only: tuple[str, ...] = RUNS,
          inject: dict[str, float] | None = None) -> dict[str, Any]:
    """Batched and one-at-a-time throughput with ``clients`` clients, one client alone, and the plain-PyTorch
    ceiling of the same rows (``only``: some of these runs); GPU utilization during the batched runs. ``inject``:
    the batched runs again with each of these parts slowed (:mod:`bench.inject`)."""
    from splitfed.trunk.timeline import save

    suffix = ("" if SERVER["mode"] == "sync" else f"_{SERVER['mode']}") + ("" if device.startswith("cuda") else "_cpu")
    kw = {"device": device, "steps": steps, "client_cores": client_cores, "socket": socket}
    n = clients
    out: dict[str, Any] = {}
    median = statistics.median
    one = [throughput(clients, 0.0, **kw) for _ in range(repeat)] if "one" in only else []
    batched = [throughput(clients, window_ms, timeline=bool(timeline) and i == 0, **kw)
               for i in range(repeat)] if "batched" in only else []
    single = median(throughput(1, 0.0, **kw).examples_per_s for _ in range(repeat)) if "single" in only else 0.0
    roof = ceiling_keys(device, n, steps, repeat, compiled=bool(SERVER["compile"])) if "ceiling" in only else {}
    one_at_a_time = median(r.examples_per_s for r in one) if one else 0.0
    best = median(r.examples_per_s for r in batched) if batched else 0.0
    if one:
        out[f"trunk_examples_per_s_{n}_clients{suffix}"] = one_at_a_time
        out[f"trunk_requests_per_s_{n}_clients{suffix}"] = median(r.requests_per_s for r in one)
    if batched:
        out[f"trunk_examples_per_s_{n}_clients_batched{suffix}"] = best
        out[f"trunk_requests_per_s_{n}_clients_batched{suffix}"] = median(r.requests_per_s for r in batched)
    if one and batched:
        out[f"trunk_batching_speedup{suffix}"] = best / one_at_a_time
    if inject and batched:
        out.update(causal(lambda: median(throughput(clients, window_ms, **kw).examples_per_s for _ in range(repeat)),
                          best, inject, n, SERVER["frontends"], n * core.SPLIT_STEP["batch"]))
    if one and single:
        out[f"sync_step_ratio_{n}v1{suffix}"] = single / one_at_a_time  # time per example, N clients / 1
    if roof:
        out.update(roof)
        where = "" if device.startswith("cuda") else "_cpu"  # the ceiling has no mode
        compiled_key = f"ceiling_examples_per_s_{n}_batched_compiled{where}"
        if batched:
            out[f"trunk_ceiling_fraction_{n}{suffix}"] = best / roof[f"ceiling_examples_per_s_{n}_batched{where}"]
            if compiled_key in roof:
                out[f"trunk_ceiling_fraction_{n}_vs_compiled{suffix}"] = best / roof[compiled_key]
        if one:
            out[f"trunk_ceiling_fraction_{n}_one_at_a_time{suffix}"] = \
                one_at_a_time / roof[f"ceiling_examples_per_s_{n}_sequential{where}"]
    out["client_cores"] = client_cores or len(os.sched_getaffinity(0))
    out["transport"] = "socket" if socket else "shared memory"
    out["frontends"] = SERVER["frontends"]
    out["mode"] = SERVER["mode"]
    out["compile"] = bool(SERVER["compile"])
    out["direct_calls"] = bool(SERVER["direct_calls"])
    out["bring_early"] = bool(SERVER["bring_early"])
    out["switch_interval_s"] = sys.getswitchinterval()  # the engine's (set by _server)
    utils = [r.gpu_util for r in batched if r.gpu_util]
    if utils:
        out[f"gpu_util_mean_{n}_batched{suffix}"] = statistics.median(u["mean"] for u in utils)
        out[f"gpu_util_max_{n}_batched{suffix}"] = max(u["max"] for u in utils)
        out["gpu_util_source"] = utils[0]["source"]
    out.update(cpu_figures([r.cpu for r in batched], f"{n}_batched{suffix}"))
    if timeline and batched[0].timeline:
        save(batched[0].timeline, timeline)
        for key, value in step_figures(batched[0].timeline).items():
            out[f"timeline_{key}"] = value
        if device.startswith("cuda"):  # the engine's reads of the GPU a sync step (bench.host_syncs)
            out["timeline_host_syncs_per_step"] = batched[0].host_syncs / steps
    return out


def scale_out(device: str = "cpu", clients: tuple[int, ...] = (8, 32), replicas: tuple[int, ...] = (2,),
              window_ms: float = 50.0, repeat: int = 1, steps: int = 5, client_cores: int = 0,
              socket: bool = False, only: tuple[str, ...] = RUNS, timeline: str = "",
              engines: tuple[int, ...] = ()) -> dict[str, Any]:
    """For each client count: one trunk one at a time (``only`` holding ``one``), one trunk batched, each count of
    ``replicas`` and of independent ``engines`` on the one device batched (examples/s); the scaling of the largest
    client count (``r`` trunks / one, ``e`` engines / one, all batched). ``timeline``: record replica 0 of the
    largest replica count (the sync step's all-reduce included), or else engine 0 of the most engines."""
    from splitfed.trunk.timeline import save

    gpu = device.startswith("cuda")
    suffix = "" if gpu else "_cpu"
    out: dict[str, Any] = {}
    kw = {"device": device, "steps": steps, "client_cores": client_cores, "socket": socket}
    largest = (max(replicas), 1) if replicas else (1, max(engines))
    for n in clients:
        runs = ([("", 0.0, 1, 1)] if "one" in only else []) + [("_batched", window_ms, 1, 1)] + \
            [(f"_batched_{r}replicas", window_ms, r, 1) for r in replicas] + \
            [(f"_batched_{e}engines", window_ms, 1, e) for e in engines]
        for name, window, r, e in runs:
            record = bool(timeline) and (r, e) == largest and n == max(clients)
            results = [throughput(n, window, replicas=r, engines=e, timeline=record and i == 0, **kw)
                       for i in range(repeat)]
            value = statistics.median(x.examples_per_s for x in results)
            out[f"trunk_examples_per_s_{n}_clients{name}{suffix}"] = value
            out.update(cpu_figures([x.cpu for x in results], f"{n}_clients{name}{suffix}"))
            utils = [x.gpu_util for x in results if x.gpu_util]
            if utils:
                out[f"gpu_util_mean_{n}_clients{name}"] = statistics.median(u["mean"] for u in utils)
            log.warning("%d clients%s: %.1f examples/s", n, name or " one at a time", value)
            if record and results[0].timeline:
                save(results[0].timeline, timeline)
                events = results[0].timeline
                for key, v in step_figures(events).items():
                    out[f"timeline_{key}"] = v
                reduces = [e for e in events if e["kind"] == "host" and e.get("what") == "all-reduce"]
                steps_at = [e["t"] for e in events if e["kind"] == "step"]
                if reduces and len(steps_at) > 1:
                    per_step = (steps_at[-1] - steps_at[0]) / (len(steps_at) - 1)
                    mean = statistics.fmean(e["end"] - e["t"] for e in reduces)
                    out[f"allreduce_bytes_per_step_{r}replicas"] = float(reduces[0]["nbytes"])
                    out[f"allreduce_ms_per_step_{r}replicas"] = mean * 1e3
                    out[f"allreduce_step_share_{r}replicas"] = mean / per_step
    n = max(clients)
    one = out[f"trunk_examples_per_s_{n}_clients_batched{suffix}"]
    for r in replicas:
        scaling = out[f"trunk_examples_per_s_{n}_clients_batched_{r}replicas{suffix}"] / one
        out[f"replica_scaling_{r}gpu" if gpu else f"replica_scaling_{r}proc_cpu"] = scaling
    for e in engines:
        out[f"engine_scaling_{e}{suffix}"] = out[f"trunk_examples_per_s_{n}_clients_batched_{e}engines{suffix}"] / one
    return out


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trunk", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clients", type=int, nargs="+", default=[4],
                        help="client counts, each measured in turn (its keys end in _<N>)")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1],
                        help="also measure these counts of trunk replicas (batched), one per GPU with --device cuda")
    parser.add_argument("--engines", type=int, nargs="+", default=[1],
                        help="also measure these counts of independent engines on the one device (batched, each "
                             "its own process and clients, no gradient exchange): engine_scaling_<K>")
    parser.add_argument("--window-ms", type=float, default=50.0, help="the server's batching window (default 50)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each kind; medians are reported (default 3)")
    parser.add_argument("--steps", type=int, default=5, help="timed sync steps per run (default 5)")
    parser.add_argument("--max-batch-tokens", type=int, default=1 << 22,
                        help="positions one batched trunk call may hold (smaller: several batches per step)")
    parser.add_argument("--frontends", type=int, default=0,
                        help="front-end processes that take the server's calls in (default 0: its event loop does)")
    parser.add_argument("--client-cores", type=int, default=0,
                        help="pin the client processes to the last K cores (default 0: all cores)")
    parser.add_argument("--socket", action="store_true", help="clients send over the socket, not shared memory")
    parser.add_argument("--no-direct", action="store_true",
                        help="the server offers no direct calls: region-carried calls go over gRPC (and the "
                             "front-ends), as before splitfed.channel.transports.direct.server")
    parser.add_argument("--bring-early", action="store_true",
                        help="the server brings a step's tensors to the device as they come, a chunk at a time "
                             "(splitfed.trunk.device.early)")
    parser.add_argument("--switch-interval", type=float, default=0.0, metavar="SECONDS",
                        help="the engine's interpreter switch interval (sys.setswitchinterval; default: Python's "
                             "5 ms): how long its event loop may keep the device thread waiting for the lock")
    parser.add_argument("--compile", action="store_true",
                        help="compile the trunk's blocks with torch.compile (the server's --compile); adds the "
                             "ceiling with the same compiled blocks")
    parser.add_argument("--mode", choices=MODES, default="sync",
                        help="the trunk's mode (default sync); keys of other modes end in _<mode>")
    parser.add_argument("--timeline", default="", metavar="FILE",
                        help="record the server's timeline of the first batched run into FILE (JSON)")
    parser.add_argument("--only", nargs="+", choices=RUNS, default=list(RUNS),
                        help="runs to make: one (one call per client), batched, single (one client), ceiling")
    parser.add_argument("--config", default="", help='model and batch, e.g. "layers=12 hidden=768 heads=12 '
                        'vocab=50257 batch=4 seq=256 bf16=1" (default: the tiny GPT-2 of python -m bench)')
    parser.add_argument("--serve", default="", metavar="HOST:PORT",
                        help="serve the trunk here for clients started elsewhere with --connect (bench.trunk_remote)")
    parser.add_argument("--connect", default="", metavar="HOST:PORT",
                        help="run only the clients, against a trunk started elsewhere with --serve")
    parser.add_argument("--inject", nargs="+", default=[], metavar="PART=US",
                        help=f"also run the batched throughput with each PART ({', '.join(PARTS)}) slowed by US "
                        "microseconds, to see which part holds the step (bench.inject)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    try:
        several = any(n > 1 for n in args.replicas + args.engines)
        inject = parse(args.inject, one_trunk=not (args.serve or args.connect or several),
                       batched="batched" in args.only, frontends=args.frontends)
    except InjectError as exc:
        parser.error(str(exc))
    if args.serve and args.connect:
        parser.error("--serve and --connect run the two sides of one benchmark: give one")
    replicas, engines = tuple(r for r in args.replicas if r > 1), tuple(e for e in args.engines if e > 1)
    if (args.serve or args.connect) and (len(args.clients) > 1 or replicas or engines):
        parser.error("--serve and --connect take one --clients count and no --replicas or --engines")
    if args.timeline and len(args.clients) > 1:
        parser.error("--timeline records one run: give one --clients count with it")
    if any(n < e for n in args.clients for e in engines):
        parser.error("--engines: every engine needs a client; give --clients at least the largest --engines")
    if args.switch_interval < 0:
        parser.error("--switch-interval: give seconds above 0 (or 0 for Python's own)")
    logging.basicConfig(level=logging.WARNING)
    SERVER.update(max_batch_tokens=args.max_batch_tokens, frontends=args.frontends, mode=args.mode,
                  compile=args.compile, direct_calls=not args.no_direct, bring_early=args.bring_early,
                  switch_interval=args.switch_interval)
    try:
        core.set_split_step(args.config)
    except ValueError as exc:
        parser.error(str(exc))
    # Clients on this host: the server keeps the cores they are not pinned to.
    if not (args.connect or args.serve):
        keep_server_off_client_cores(args.client_cores)
    try:
        if args.serve:
            results = trunk_remote.serve(args.serve, args.clients[0], device=args.device, window_ms=args.window_ms,
                                         steps=args.steps, timeline=args.timeline, only=tuple(args.only),
                                         settings=dict(SERVER))
        elif args.connect:
            results = trunk_remote.connect(args.connect, args.clients[0], steps=args.steps,
                                           client_cores=args.client_cores)
        elif replicas or engines:
            results: dict[str, Any] = dict(scale_out(args.device, tuple(args.clients), replicas, args.window_ms,
                                                     args.repeat, args.steps, args.client_cores, args.socket,
                                                     tuple(args.only), args.timeline, engines))
        else:  # each count of clients in turn (its keys end in _<N>)
            results = {}
            for clients in args.clients:
                results.update(trunk(args.device, clients, args.window_ms, args.repeat, args.steps,
                                     args.client_cores, args.socket, args.timeline, tuple(args.only), inject))
    except (BenchError, SplitFedError) as exc:  # SplitFedError: the server's own (a port in use, say)
        log.error("bench.trunk failed: %s", exc)
        return 1
    if not args.connect:
        results["server_cores"] = len(os.sched_getaffinity(0))  # this process's cores, pinned or not
    results["config"] = " ".join(f"{k}={v}" for k, v in core.SPLIT_STEP.items())
    results["device"] = torch.cuda.get_device_name() if args.device.startswith("cuda") and not args.connect \
        else "cpu"
    core.print_results(results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
