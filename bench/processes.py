"""What a benchmark starts, watched and ended: waits that fail at once when the process they wait on dies, and
the ending of what a benchmark or test run started (a SuperLink, Ray, their children)."""

from __future__ import annotations

import os
import queue
import signal
import time
from collections.abc import Sequence
from typing import Any


class BenchError(RuntimeError):
    """A benchmark could not do its job: a process it started died or stalled, or a run it made failed. Its
    command exits non-zero with this message."""


def get_from(source: Any, procs: Sequence[Any], timeout_s: float, what: str) -> Any:
    """The next item of the multiprocessing queue ``source``, which ``procs`` (multiprocessing processes) fill.

    Waits at most ``timeout_s``, checking twice a second that every process in ``procs`` is still running: they
    are meant to outlive the wait, so one that has ended is an error at once (after a last look at the queue, in
    case it put the item just before it exited).

    Raises:
        BenchError: a process in ``procs`` ended (its pid and exit code are in the message), or nothing came
            within ``timeout_s``; ``what`` says what was awaited.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return source.get(timeout=0.5)
        except queue.Empty:
            pass
        ended = [p for p in procs if p.exitcode is not None]
        if ended:
            try:
                return source.get(timeout=0.5)
            except queue.Empty:
                raise BenchError(f"{what}: process {ended[0].pid} ended with exit code {ended[0].exitcode} before "
                                 "it was sent (its error is above)") from None
        if time.monotonic() > deadline:
            raise BenchError(f"{what}: nothing within {timeout_s:.0f} s, though its processes still run")


def check_alive(procs: Sequence[Any], what: str) -> None:
    """Raise :class:`BenchError` if a process in ``procs`` has ended (they are meant to run until told to stop)."""
    for p in procs:
        if p.exitcode is not None:
            raise BenchError(f"{what} (process {p.pid}) ended with exit code {p.exitcode} during the run")


def end_children(procs: Sequence[Any], timeout_s: float = 30.0) -> None:
    """Wait at most ``timeout_s`` for each multiprocessing process to end, then kill what is left."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.1))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def end_processes_of(*markers: str) -> None:
    """End every process whose command line names one of ``markers`` or whose ``FLWR_HOME`` is one of them,
    with their children: SIGTERM, then SIGKILL for those still alive after 10 s."""
    import psutil

    procs = []
    for p in psutil.process_iter(["pid", "cmdline", "environ"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            env = p.info.get("environ") or {}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if p.pid != os.getpid() and (any(m in cmd for m in markers) or env.get("FLWR_HOME") in markers):
            procs.append(p)
    for p in list(procs):
        try:
            procs.extend(p.children(recursive=True))
        except psutil.NoSuchProcess:  # it ended between the scan and now
            pass
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
