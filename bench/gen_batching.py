"""Batched split generation: tokens/s of concurrent inference sessions with and without batched decode steps.

* ``gen_batched_speedup``: total generated tokens per second of ``sessions``
  concurrent clients (8 by default), each in its own process with its own
  channel and session, against a trunk server whose scheduler batches decode
  steps (``batch_window_ms`` > 0) / the same server stepping sessions one by
  one (``batch_window_ms`` = 0). Runs alternate (unbatched, batched, ...) and
  the medians are compared.
* ``gen_trunk_decode_speedup``: the trunk alone, in this process: ``sessions``
  decode steps as one batched call / one by one (no channel, no clients).
* ``gen_fixed_step_share``: the share of the batched run's session steps that ran
  over a fixed-size cache (as CUDA graphs on a GPU: ``decode_steps``, ``--decode-steps``;
  prefills never do); ``gen_graph_captures``: the graphs that run captured.
* ``gen_batched_greedy_match``: 1.0 when every session's greedy tokens are the
  same with and without batching.
* ``gen_client_ms_per_token``: each generating client's own work per token in
  the batched run (its bottom, top and sampling, and the host copies around
  them: a token's time less the time inside the session's step), median over
  clients; ``gen_client_bound_speedup`` is what the clients allow: ``sessions``
  tokens per ``gen_client_ms_per_token`` (a server that answered at once) over
  the one-by-one tokens/s. Where clients share one GPU (every client process on
  one card) their work is time-sliced, and this bound is what the batched
  speedup can reach.
* ``gen_engine_loop_cores`` / ``gen_engine_device_cores`` (``gen_replay_*`` for the
  replaying clients): the cores the batched server's event loop and device thread
  kept busy over the run (warm-up included), which share one interpreter lock:
  together near 1, the server's Python is what holds the rate;
  ``gen_engine_loop_us_per_call``: the event loop's CPU per session step (its
  busy time over the batched run / the steps the server took): what taking in
  one decode-step call costs, paid once per session and token, one call after
  another; ``gen_engine_loop_turns_per_call``: the event loop's turns over the
  batched run / the steps it took (each turn a wait in the kernel and a pass over
  what is ready; calls that arrive together share turns);
  ``gen_gpu_util_mean``: the GPU's utilization meanwhile (the clients' work on it
  included).
* ``gen_direct_share`` (``gen_replay_direct_share``): the share of the batched
  run's session steps that went over a shared-memory region's direct-call link
  rather than gRPC: a client opens a region with its first tensor of 64 KiB or
  more, and its small steps take the region's link from then on
  (:meth:`SharedLane.inline <splitfed.channel.transports.shm.lane.SharedLane.inline>`).
* ``gen_batched_speedup_window_<W>ms`` (``gen_batched_tokens_per_s_window_<W>ms``,
  ``gen_batched_mean_batch_window_<W>ms``): with more than one ``--gen-window-ms``, the
  generating clients against a server batching over each further window too, in the
  same run and against the same one-by-one runs (the first window gives the keys above).
* ``gen_client_decode_steps``: the clients' ``generate(decode_steps=...)``
  (``--client-decode-steps``: ``auto`` replays their bottom's and top's decode steps as
  CUDA graphs on a GPU, :mod:`splitfed.client.decoding`).
* ``gen_replay_batched_speedup``: the same clients and servers, but each client
  replays ``new_tokens`` one-position steps of random hidden states through its
  session (no bottom, top or sampling): the server and the channel alone, so
  that what the clients' own per-token work costs can be told apart.

On CPU every process computes on one thread, the server's included: the
clients and the server share the machine's cores (intra-op threads of a server
that shares its cores with 8 busy processes mostly wait for each other).

Models: on CPU a tiny GPT-2 (6 layers, hidden 256, vocab 8192, cuts 2/4); with
``--device cuda`` a GPT-2-small-sized trunk (GPT-2 small's width, heads and
vocabulary; 14 blocks cut 1/13, so the trunk holds 12 blocks and each client
1 block below and 1 above). ``--gen-sessions``, ``--gen-window-ms``,
``--gen-new-tokens`` change the load; ``--switch-interval SECONDS`` sets the server process's interpreter switch
interval (``sys.setswitchinterval``; Python's 5 ms by default; ``switch_interval_s`` in the output).

    python -m bench.gen_batching [--device cuda] [--no-replay] [--json]
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from bench.core import print_results
from bench.gen_clients import MODELS, build, client
from bench.processes import end_children, get_from


def _mean_batch(stats: dict[str, int]) -> float:
    """Sessions per multi-member decode step, from a session manager's ``stats``."""
    return stats.get("batched_steps", 0) / max(stats.get("decode_batches", 0), 1)


def batched_generation(sessions: int = 8, new_tokens: int = 64, prompt_len: int = 16, window_ms: float = 5.0,
                       repeat: int = 2, device: str = "cpu", model: str | None = None,
                       replay: bool = True, decode_steps: str = "auto",
                       client_decode_steps: str = "auto", more_windows: Sequence[float] = ()) -> dict[str, Any]:
    """Tokens/s of ``sessions`` concurrent generating clients, batched decode steps / one by one.

    Args:
        sessions: concurrent clients, one session each, each in its own process.
        new_tokens: tokens each session generates (no early stop).
        prompt_len: the first client's prompt length; client ``i``'s is ``prompt_len + i``.
        window_ms: the batched server's ``batch_window_ms``.
        repeat: timed runs of each server (alternating); medians are compared.
        device: where the trunk and the clients' parts run.
        model: ``tiny`` or ``gpt2-small`` (default: tiny on CPU, gpt2-small on CUDA).
        replay: also time clients that replay one-position steps (``gen_replay_*``).
        decode_steps: both servers' ``decode_steps`` (:mod:`splitfed.trunk.inference.fixedsteps`).
        client_decode_steps: the generating clients' ``generate(decode_steps=...)`` (:mod:`splitfed.client.decoding`).
        more_windows: further batching windows (ms) the generating clients run against in the same run, each
            compared with the same one-by-one runs (``gen_batched_*_window_<W>ms``).
    """
    from bench.cpu_use import ENGINE_THREADS, CpuUse, LoopTurns
    from splitfed.trunk.inference.sessions import SessionLimits
    from bench.gpu_util import UtilSampler
    from splitfed.channel.server.trunkserver import TrunkServer

    name = model or ("gpt2-small" if device.startswith("cuda") else "tiny")
    ctx = mp.get_context("spawn")
    jobs, results, barrier = [ctx.Queue() for _ in range(sessions)], ctx.Queue(), ctx.Barrier(sessions)
    procs = [ctx.Process(target=client, args=(r, name, device, prompt_len, new_tokens, jobs[r], results, barrier,
                                               client_decode_steps), daemon=True) for r in range(sessions)]
    for p in procs:
        p.start()
    trunk = build(name, device).trunk
    trunk.requires_grad_(False)
    modes = (False, True) if replay else (False,)
    windows = {mode: (0.0, window_ms) + (() if mode else tuple(more_windows)) for mode in modes}
    rates: dict[tuple[bool, float], list[float]] = {(r, w): [] for r in modes for w in windows[r]}
    mean_batches: dict[float, list[float]] = {w: [] for w in more_windows}
    tokens: dict[float, dict[int, list[int]]] = {}
    stats: dict[bool, dict[str, int]] = {}
    server_use: dict[bool, list[dict[str, float]]] = {mode: [] for mode in modes}  # batched runs: cores, GPU
    own_s: list[float] = []  # each generating client's own work in the batched runs
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    try:
        for _ in range(repeat):
            for mode in modes:
                for window in windows[mode]:
                    server = TrunkServer(trunk, insecure=True, batch_window_ms=window,
                                         session_limits=SessionLimits(decode_steps=decode_steps)).start()
                    try:
                        use, util = CpuUse({}, ENGINE_THREADS).start(), UtilSampler(device).start()
                        turns = LoopTurns(server._serving.loop).start()
                        began = time.perf_counter()
                        for q in jobs:
                            q.put((server.address, mode))
                        got = [get_from(results, procs, 600, "a generating client's tokens") for _ in range(sessions)]
                        took = time.perf_counter() - began
                        figures = use.stop(took)
                        figures["loop_turns"] = turns.stop()
                        figures["gpu_util"] = util.stop().get("mean", float("nan"))
                        st = dict(server.servicer.sessions.stats)
                        if window in mean_batches and window != window_ms:
                            mean_batches[window].append(_mean_batch(st))
                        elif window:
                            stats[mode] = st
                            per_session = new_tokens + 1 if mode else new_tokens  # a replay's prefill is a step more
                            figures["direct_share"] = sum(g[5] for g in got) / (sessions * per_session)
                            figures["loop_turns_per_call"] = figures["loop_turns"] / max(st.get("steps", 0), 1)
                            figures["loop_us_per_call"] = (figures["engine-loop_cores"] * took
                                                           / max(st.get("steps", 0), 1) * 1e6)
                            server_use[mode].append(figures)
                    finally:
                        server.stop(grace=0)
                    elapsed = max(g[2] for g in got) - min(g[1] for g in got)
                    rates[mode, window].append(sessions * new_tokens / elapsed)
                    if not mode:
                        tokens[window] = {g[0]: g[3] for g in got}
                        if window == window_ms:
                            own_s.extend(g[4] for g in got)
    finally:
        torch.set_num_threads(threads)
        for q in jobs:
            q.put(None)
        end_children(procs)
    out: dict[str, Any] = {"gen_client_decode_steps": client_decode_steps}
    for w in more_windows:
        rate = statistics.median(rates[False, w])
        out[f"gen_batched_tokens_per_s_window_{w:g}ms"] = rate
        out[f"gen_batched_speedup_window_{w:g}ms"] = rate / statistics.median(rates[False, 0.0])
        out[f"gen_batched_mean_batch_window_{w:g}ms"] = statistics.median(mean_batches[w])
    for mode in modes:
        key = "gen_replay" if mode else "gen"
        batched, alone = statistics.median(rates[mode, window_ms]), statistics.median(rates[mode, 0.0])
        st = stats.get(mode, {})
        out.update({
            f"{key}_batched_speedup": batched / alone,
            f"{key}_batched_tokens_per_s": batched,
            f"{key}_unbatched_tokens_per_s": alone,
            f"{key}_batched_mean_batch": _mean_batch(st),
            f"{key}_engine_loop_cores": statistics.median(u["engine-loop_cores"] for u in server_use[mode]),
            f"{key}_engine_device_cores": statistics.median(u["engine-device_cores"] for u in server_use[mode]),
            f"{key}_engine_loop_us_per_call": statistics.median(u["loop_us_per_call"] for u in server_use[mode]),
            f"{key}_engine_loop_turns_per_call": statistics.median(u["loop_turns_per_call"] for u in server_use[mode]),
            f"{key}_direct_share": statistics.median(u["direct_share"] for u in server_use[mode]),
        })
        if device.startswith("cuda"):
            out[f"{key}_gpu_util_mean"] = statistics.median(u["gpu_util"] for u in server_use[mode])
        if not mode:
            own_ms = 1000 * statistics.median(own_s) / new_tokens
            out.update({"gen_client_ms_per_token": own_ms,
                        "gen_client_bound_speedup": sessions * 1000 / own_ms / alone})
            out.update({"gen_batched_greedy_match": float(all(tokens[0.0] == tokens[w] for w in windows[mode])),
                        "gen_batched_sessions": float(sessions),
                        "gen_batched_regroups": float(st.get("decode_groups", 0)),
                        "gen_fixed_step_share": st.get("fixed_steps", 0) / max(st.get("steps", 0), 1),
                        "gen_graph_captures": float(st.get("graph_captures", 0)),
                        "gen_batched_prefills": float(st.get("batched_prefills", 0)),
                        "gen_prefill_batches": float(st.get("prefill_batches", 0))})
    return out


def batched_decode_trunk(sessions: int = 8, steps: int = 64, prompt_len: int = 16, repeat: int = 3,
                         device: str = "cpu", model: str | None = None, decode_steps: str = "auto") -> dict[str, float]:
    """The trunk alone (no channel, no clients): ``sessions`` decode steps as one call / one by one.

    Every session is prefilled (prompts of ``prompt_len + i`` positions: one batched
    prefill, or one step per session, timed as ``gen_trunk_prefill_speedup``), then
    each timed run decodes ``steps`` positions per session either with
    :meth:`SessionManager.run_many` (one batched call per step) or with one
    :meth:`SessionManager.run_many` of one step per session (a window each, as a
    server without a batching window runs them); runs alternate, medians compared.
    ``decode_steps``: the manager's (:mod:`splitfed.trunk.inference.fixedsteps`).
    """
    from splitfed.split import CutState
    from splitfed.trunk.inference.decoding import SessionStep
    from splitfed.trunk.compute.runtime import TrunkRuntime
    from splitfed.trunk.inference.sessions import SessionManager

    name = model or ("gpt2-small" if device.startswith("cuda") else "tiny")
    trunk = build(name, device).trunk
    trunk.requires_grad_(False)
    width = MODELS[name][1]
    manager = SessionManager(TrunkRuntime(trunk), max_sessions=4 * sessions, max_sessions_per_client=4 * sessions,
                             decode_steps=decode_steps)
    g = torch.Generator().manual_seed(0)
    times: dict[bool, list[float]] = {False: [], True: []}
    prefill_times: dict[bool, list[float]] = {False: [], True: []}

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    for run in range(repeat + 1):  # the first round warms up
        for batched in (False, True):
            ids = [manager.open("bench", max_length=prompt_len + sessions + steps)[0] for _ in range(sessions)]
            prompts = [CutState(torch.randn(1, prompt_len + i, width, generator=g)) for i in range(sessions)]
            sync()
            start = time.perf_counter()
            if batched:  # the prompts as one window: one batched prefill
                for out in manager.run_many([SessionStep("bench", sid, p) for sid, p in zip(ids, prompts)]):
                    if isinstance(out, BaseException):
                        raise out
            else:
                for sid, p in zip(ids, prompts):
                    manager.step("bench", sid, p)
            sync()
            if run:
                prefill_times[batched].append(time.perf_counter() - start)
            hidden = [torch.randn(1, 1, width, generator=g) for _ in range(steps)]
            sync()
            start = time.perf_counter()
            for t in range(steps):
                if batched:
                    for out in manager.run_many([SessionStep("bench", sid, CutState(hidden[t])) for sid in ids]):
                        if isinstance(out, BaseException):
                            raise out
                else:  # each step its own window, as a server with no batching window runs it
                    for sid in ids:
                        out = manager.run_many([SessionStep("bench", sid, CutState(hidden[t]))])[0]
                        if isinstance(out, BaseException):
                            raise out
            sync()
            if run:
                times[batched].append(time.perf_counter() - start)
            for sid in ids:
                manager.close("bench", sid)
    alone, batched_s = statistics.median(times[False]), statistics.median(times[True])
    return {"gen_trunk_decode_speedup": alone / batched_s,
            "gen_trunk_decode_tokens_per_s": sessions * steps / batched_s,
            "gen_trunk_prefill_speedup": statistics.median(prefill_times[False]) / statistics.median(
                prefill_times[True])}


def gen_batching(device: str = "cpu", sessions: int = 8, new_tokens: int = 64, repeat: int = 2) -> dict[str, float]:
    """The suite ``python -m bench`` runs: the trunk alone, then concurrent clients over the channel."""
    out = batched_decode_trunk(sessions, new_tokens, repeat=repeat + 1, device=device)
    out.update(batched_generation(sessions, new_tokens, repeat=repeat, device=device))
    return out


def main() -> int:
    """``python -m bench.gen_batching [--device cuda] [--gen-sessions N] [--json]``."""
    from splitfed.client.decoding import CLIENT_DECODE_STEPS
    from splitfed.trunk.inference.fixedsteps import DECODE_STEPS

    parser = argparse.ArgumentParser(prog="python -m bench.gen_batching", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--gen-model", choices=sorted(MODELS), help="default: tiny on CPU, gpt2-small on CUDA")
    parser.add_argument("--gen-sessions", type=int, default=8)
    parser.add_argument("--gen-window-ms", type=float, nargs="+", default=[5.0], metavar="MS",
                        help="the batched server's window; more values run against it in the same run "
                             "(gen_batched_*_window_<MS>ms)")
    parser.add_argument("--gen-new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--no-replay", action="store_true", help="skip the replaying clients (gen_replay_*)")
    parser.add_argument("--switch-interval", type=float, default=0.0, metavar="SECONDS",
                        help="the server process's interpreter switch interval (0: Python's own, 5 ms)")
    parser.add_argument("--decode-steps", choices=DECODE_STEPS, default="auto",
                        help="the servers' decode steps (auto: CUDA graphs on a GPU)")
    parser.add_argument("--client-decode-steps", choices=CLIENT_DECODE_STEPS, default="auto",
                        help="the generating clients' bottom and top decode steps (auto: CUDA graphs on a GPU)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if any(w <= 0 for w in args.gen_window_ms) or len(set(args.gen_window_ms)) < len(args.gen_window_ms):
        parser.error("--gen-window-ms: give distinct windows above 0 ms")
    if args.switch_interval < 0:
        parser.error("--switch-interval: give seconds above 0 (or 0 for Python's own)")
    logging.basicConfig(level=logging.WARNING)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)  # the server runs in this process; the clients are spawned
    results = batched_decode_trunk(args.gen_sessions, args.gen_new_tokens, repeat=args.repeat + 1,
                                   device=args.device, model=args.gen_model, decode_steps=args.decode_steps)
    results.update(batched_generation(args.gen_sessions, args.gen_new_tokens, window_ms=args.gen_window_ms[0],
                                      repeat=args.repeat, device=args.device, model=args.gen_model,
                                      replay=not args.no_replay, decode_steps=args.decode_steps,
                                      client_decode_steps=args.client_decode_steps,
                                      more_windows=args.gen_window_ms[1:]))
    results["switch_interval_s"] = sys.getswitchinterval()
    print_results(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
