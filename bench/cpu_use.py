"""Host CPU spent while a benchmark runs: how busy the host's cores were, and each process group's CPU seconds.

A trunk server whose clients run on its own host shares the host's cores with them. Whether a run was bound by
those cores, and which processes used them (the engine, its front-ends, the clients), says how far a figure
measured that way is from a server whose clients are elsewhere.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import psutil


def _cpu_seconds(pids: Iterable[int]) -> float:
    """User and system CPU seconds of the processes ``pids`` so far (those gone count 0)."""
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += t.user + t.system
    return total


def _thread_seconds(names: Iterable[str]) -> float:
    """CPU seconds so far of this process's threads whose Python names are in ``names``: from each thread's own CPU
    clock (nanoseconds, ``pthread_getcpuclockid``) where the platform has one, else from psutil (in the kernel's
    clock ticks, 10 ms)."""
    wanted = set(names)
    threads = [t for t in threading.enumerate() if t.name in wanted and t.ident is not None]
    clock = getattr(time, "pthread_getcpuclockid", None)
    if clock is not None:
        total = 0.0
        for t in threads:
            try:
                total += time.clock_gettime(clock(t.ident))
            except OSError:  # the thread ended meanwhile
                continue
        return total
    ids = {t.native_id for t in threads}
    return sum(t.user_time + t.system_time for t in psutil.Process().threads() if t.id in ids)


class CpuUse:
    """Between :meth:`start` and :meth:`stop`: the share of the host's cores that were busy, and the CPU seconds
    of named groups of processes (``{"engine": [pid], "front-ends": [...]}``) and of named groups of this
    process's threads (``{"engine-loop": ["splitfed-trunk-grpc"]}``, by their Python names).

    ``psutil`` counts a process's threads together; a group's figure over the run's seconds is how many cores it
    kept busy on average. A process that ends before :meth:`stop` (and is reaped) is no longer readable: processes
    that may end first count their own CPU and pass it to :meth:`stop`.
    """

    def __init__(self, groups: Mapping[str, Iterable[int]], threads: Mapping[str, Iterable[str]] | None = None
                 ) -> None:
        self.groups = {name: [int(p) for p in pids] for name, pids in groups.items()}
        self.threads = {name: tuple(names) for name, names in (threads or {}).items()}
        self._host: Any = None
        self._before: dict[str, float] = {}

    def start(self) -> CpuUse:
        """Take the starting counts."""
        self._host = psutil.cpu_times()
        self._before = {name: _cpu_seconds(pids) for name, pids in self.groups.items()}
        self._before.update({name: _thread_seconds(names) for name, names in self.threads.items()})
        return self

    def stop(self, seconds: float, **reported: float) -> dict[str, float]:
        """The figures since :meth:`start`, over a run of ``seconds``: ``host_busy`` (0-1, all cores),
        ``cores`` (the host's), and per group ``<name>_cores`` (cores it kept busy on average). ``reported``: CPU
        seconds of groups that counted their own (processes that may have ended before this call), by name."""
        if self._host is None or seconds <= 0:
            return {}
        after = psutil.cpu_times()
        idle = (after.idle + getattr(after, "iowait", 0.0)) - (self._host.idle + getattr(self._host, "iowait", 0.0))
        total = sum(after) - sum(self._host)
        out: dict[str, float] = {"cores": float(os.cpu_count() or 1),
                                 "host_busy": max(0.0, 1.0 - idle / total) if total > 0 else 0.0}
        for name, pids in self.groups.items():
            out[f"{name}_cores"] = max(0.0, _cpu_seconds(pids) - self._before[name]) / seconds
        for name, names in self.threads.items():
            out[f"{name}_cores"] = max(0.0, _thread_seconds(names) - self._before[name]) / seconds
        for name, cpu_s in reported.items():
            out[f"{name}_cores"] = cpu_s / seconds
        return out


def process_groups(server: Any, clients: Iterable[Any]) -> dict[str, list[int]]:
    """A trunk bench's server-side processes by role: this one (the engine, or rank 0's), ``server``'s front-ends,
    and any other process under this one but the ``clients`` (processes with a ``pid``; they count their own CPU,
    see :meth:`CpuUse.stop`): the other replicas and theirs."""
    frontends = [p.pid for p in getattr(server.frontends, "processes", None) or []]
    known = {os.getpid(), *frontends, *(p.pid for p in clients)}
    others = [c.pid for c in psutil.Process().children(recursive=True) if c.pid not in known]
    return {"engine": [os.getpid()], "front-ends": frontends, "others": others}


#: The engine's own threads by role, as :class:`CpuUse` counts them (their names in :mod:`splitfed.channel.server.trunkserver`
#: and :mod:`splitfed.trunk.scheduler`): the event loop that takes the calls in and answers them, and the device
#: threads that run the trunks' work.
ENGINE_THREADS = {"engine-loop": ("splitfed-trunk-grpc",), "engine-device": ("splitfed-trunk-device",)}


def cpu_figures(runs: list[dict[str, float]], tag: str) -> dict[str, float]:
    """Bench keys from several runs' :meth:`CpuUse.stop` figures (medians): ``host_cores``,
    ``cpu_host_busy_<tag>`` and ``cpu_<group>_cores_<tag>``."""
    runs = [r for r in runs if r]
    if not runs:
        return {}
    out: dict[str, float] = {"host_cores": int(runs[0]["cores"])}
    for key in runs[0]:
        if key != "cores":
            out[f"cpu_{key.replace('-', '_')}_{tag}"] = statistics.median(r[key] for r in runs)
    return out


class LoopTurns:
    """How many turns an asyncio event loop running on another thread makes between :meth:`start` and :meth:`stop`.

    Each turn of a selector event loop waits in its selector once, so a counter around the selector's ``select``
    (set on that one selector object, and removed again by :meth:`stop`) counts the turns. Over a run's calls it
    says how many turns a call costs the loop: each turn is a wait in the kernel and a pass over what is ready.
    """

    def __init__(self, loop: Any) -> None:
        self._selector = loop._selector  # a selector event loop's own (asyncio's default on Linux)
        self.turns = 0

    def start(self) -> LoopTurns:
        inner = self._selector.select

        def select(timeout: float | None = None) -> Any:
            self.turns += 1
            return inner(timeout)
        self._selector.select = select
        return self

    def stop(self) -> int:
        """Stop counting; the turns counted."""
        self._selector.__dict__.pop("select", None)
        return self.turns
