"""The client processes of ``python -m bench.trunk``: each joins, warms up and runs its timed sync steps; the parent
collects their reports and fails at once when one dies or fails."""

from __future__ import annotations

import json
import os
import queue
import time
import uuid
from typing import Any

import torch

#: Seconds a benchmark waits for its clients at any one point before it gives up.
WAIT_S = 900.0
#: Seconds a client of a trunk on another host waits for it to come up.
READY_S = 120.0


def client_name(i: int) -> str:
    """The client id bench client ``i`` uses on the trunk."""
    return f"bench-{i}"


class BenchError(RuntimeError):
    """A benchmark could not do its job (a client died or failed, or it timed out)."""


def run_client(address: str, i: int, settings: dict[str, int], steps: int, warmup: int, cores: list[int] | None,
               socket: bool, events: Any, go: Any, start: Any, group: int = 0) -> None:
    """One client process: join, say so, wait; warm up, say so, wait; ``steps`` timed sync steps; say done (with
    the steps' marks and the CPU seconds they took).

    Without ``start`` and ``go`` (a trunk on another host: no event crosses the hosts), it waits instead until the
    trunk's step group has ``group`` members, and leaves the group when it fails, so that the server sees it."""
    from bench.inject import client_delay, spin
    from splitfed.channel.client.trunk import TrunkClient
    from splitfed.split import CutState
    from splitfed.tuning import freeze_heap

    tc = None
    try:
        if cores:
            os.sched_setaffinity(0, cores)
        torch.set_num_threads(1)
        c = settings
        tc = TrunkClient(address, insecure=True, client_id=client_name(i), wire_dtype="bf16" if c["bf16"] else "fp32",
                         shared_memory="off" if socket else "auto")
        if start is None:  # a trunk on another host, maybe still starting
            tc.wait_ready(timeout=READY_S)
        size = tc.join()
        # Held in the wire's dtype: a client casts its activations and gradients where it computes them (on its
        # GPU, under bf16 autocast); a cast here would be its compute, on the server's host.
        dtype = torch.bfloat16 if c["bf16"] else torch.float32
        hidden = torch.randn(c["batch"], c["seq"], c["hidden"]).to(dtype)
        grad = (torch.randn(c["batch"], c["seq"], c["hidden"]) * 1e-3).to(dtype)
        events.put(("joined", i, ""))
        if start is None:  # every client is in the step group before the first sync step
            deadline = time.monotonic() + WAIT_S
            while size < group:
                if time.monotonic() > deadline:
                    raise BenchError(f"the trunk's step group reached {size} of {group} clients in {WAIT_S:.0f} s")
                time.sleep(0.05)
                size = tc.join()  # joining again only says the group's size
        elif not start.wait(WAIT_S):
            raise BenchError("the benchmark never started the steps")
        # As the server does (splitfed.tuning): a full collection over torch's objects would hold this client's
        # call, and with it the whole sync step, for 100-200 ms now and then.
        freeze_heap()
        marks: list[tuple[str, float]] = []  # perf_counter is CLOCK_MONOTONIC: one clock for every process
        delay = client_delay()
        clock = time.perf_counter
        cpu = 0.0
        for step in range(warmup + steps):
            if step == warmup:
                if go is not None:
                    events.put(("warm", i, ""))
                    if not go.wait(WAIT_S):  # the whole group finished the warm-up together
                        raise BenchError("the benchmark never started the timed steps")
                cpu = time.process_time()  # this process's CPU (all its threads) over the timed steps
            act = uuid.uuid4().hex
            spin(delay)  # bench.inject: a delay before each call (0: none)
            marks.append(("client-forward-sent", clock()))
            tc.forward(CutState(hidden), activation_id=act, train=True, num_examples=c["batch"])
            spin(delay)
            marks.append(("client-backward-sent", clock()))
            tc.backward(act, grad)
            marks.append(("client-backward-got", clock()))
        cpu = time.process_time() - cpu
        tc.close()
        events.put(("done", i, json.dumps({"marks": marks[3 * warmup:], "cpu_s": cpu})))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        if start is None and tc is not None:
            tc.close()  # leave: the server side sees the group empty and fails too
        events.put(("error", i, repr(exc)))


def collect(events: Any, procs: list[Any], kind: str, n: int) -> dict[int, str]:
    """Wait for ``n`` ``kind`` messages from the clients (returned by client); raise :class:`BenchError` at once
    if one fails or dies."""
    seen: dict[int, str] = {}
    deadline = time.monotonic() + WAIT_S
    while len(seen) < n:
        try:
            what, i, detail = events.get(timeout=0.5)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise BenchError(f"benchmark client process {dead[0].pid} died with exit code "
                                 f"{dead[0].exitcode}") from None
            if time.monotonic() > deadline:
                raise BenchError(f"only {len(seen)} of {n} clients reached {kind!r} within {WAIT_S:.0f} s") from None
            continue
        if what == "error":
            raise BenchError(f"benchmark client {i} failed: {detail}")
        if what == kind:
            seen[i] = detail
    return seen


def pick_cores(client_cores: int) -> list[int] | None:
    """The cores the client processes are pinned to: the last ``client_cores`` (None: no pinning)."""
    if client_cores <= 0:
        return None
    available = sorted(os.sched_getaffinity(0))
    return available[-client_cores:]


def keep_server_off_client_cores(client_cores: int) -> list[int] | None:
    """Pin this process (the trunk server: its threads and front-end processes start later and inherit it) to the
    cores :func:`pick_cores` leaves, as if the clients were on a host of their own; the cores kept, or None when
    nothing is pinned (no ``client_cores``, or no core left beside them)."""
    available = sorted(os.sched_getaffinity(0))
    if client_cores <= 0 or client_cores >= len(available):
        return None
    kept = available[:-client_cores]
    os.sched_setaffinity(0, kept)
    return kept
