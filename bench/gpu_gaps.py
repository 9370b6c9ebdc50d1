"""When a GPU sat idle in a ``torch.profiler`` trace, and what the host was doing meanwhile.

:func:`gpu_gaps` reads a Chrome trace (``prof.export_chrome_trace``; events of ``ph == "X"``) and merges the
device's kernels, copies and fills into busy spans. What lies between two spans, from the first device event to
the last, is idle time; for each of the longest idle gaps it names the host operations (``cpu_op``,
``python_function`` and ``user_annotation`` events, on any thread, shorter than half the span) that overlap it
most, and the profiler's own overhead events: a gap they fill is the profiler's (``profiler_us``). ``python -m
bench.trunk_runtime --device cuda --trace step.json`` prints this summary for the step it traces;
``python -m bench.gpu_gaps step.json`` for any trace.

The profiler slows the host (each operation it records costs a few microseconds), so a profiled step is longer
than an unprofiled one and its gaps are upper bounds; the device's busy time is the device's own.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: Trace categories of the device's own work.
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
#: Trace categories of the host's work ("overhead": the profiler's own, such as CUPTI's "Activity Buffer Request").
HOST_CATEGORIES = frozenset({"cpu_op", "python_function", "user_annotation", "overhead"})


@dataclass
class Gap:
    """An interval (microseconds, trace clock) in which the device ran nothing, and the host work overlapping it."""

    start: float
    end: float
    #: ``(name, microseconds of overlap, thread)``, most overlap first.
    host: list[tuple[str, float, Any]] = field(default_factory=list)

    @property
    def us(self) -> float:
        return self.end - self.start


@dataclass
class GapReport:
    """A trace's device time: its span, busy and idle time, copies, and its longest idle gaps."""

    span_us: float
    busy_us: float
    copy_us: float
    gaps: list[Gap]
    #: Idle time in which the profiler itself was busy (its ``overhead`` events): not the program's.
    profiler_us: float = 0.0
    #: The first device event's start: the gaps' times in :meth:`lines` count from it.
    origin_us: float = 0.0

    @property
    def busy_fraction(self) -> float:
        return self.busy_us / self.span_us if self.span_us > 0 else 0.0

    def keys(self, prefix: str = "trace") -> dict[str, float]:
        """The report as bench keys (milliseconds)."""
        return {f"{prefix}_gpu_span_ms": self.span_us / 1e3, f"{prefix}_gpu_busy_ms": self.busy_us / 1e3,
                f"{prefix}_gpu_copy_ms": self.copy_us / 1e3, f"{prefix}_gpu_busy_fraction": self.busy_fraction,
                f"{prefix}_gpu_idle_ms": (self.span_us - self.busy_us) / 1e3,
                f"{prefix}_gpu_idle_profiler_ms": self.profiler_us / 1e3}

    def lines(self, top: int = 8) -> list[str]:
        """The longest gaps, one line each, for a log."""
        out = []
        for gap in self.gaps[:top]:
            host = ", ".join(f"{name} {us / 1e3:.2f}" for name, us, _ in gap.host[:4]) or "no host event"
            out.append(f"idle {gap.us / 1e3:.2f} ms at {(gap.start - self.origin_us) / 1e3:.2f} ms: {host}")
        return out


def _intervals(events: Iterable[dict[str, Any]]) -> list[tuple[float, float]]:
    return sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events)


def _merged(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def gpu_gaps(trace: dict[str, Any] | Sequence[dict[str, Any]], top: int = 8, min_gap_us: float = 20.0
             ) -> GapReport:
    """The device's busy and idle time in ``trace`` (a Chrome trace object or its list of events), with the
    ``top`` longest idle gaps of at least ``min_gap_us`` and the host work overlapping each.

    Raises :class:`ValueError` when the trace holds no device event (a CPU run, or a trace without
    ``ProfilerActivity.CUDA``)."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    complete = [e for e in events if e.get("ph") == "X" and "ts" in e]
    device = [e for e in complete if e.get("cat") in DEVICE_CATEGORIES]
    if not device:
        raise ValueError("the trace holds no GPU kernel or copy: profile with ProfilerActivity.CUDA on a GPU")
    spans = _merged(_intervals(device))
    busy = sum(end - start for start, end in spans)
    copies = sum(end - start for start, end in _merged(_intervals(e for e in device if e.get("cat") != "kernel")))
    idle = [Gap(a_end, b_start) for (_, a_end), (b_start, _) in zip(spans, spans[1:])
            if b_start - a_end >= min_gap_us]
    overhead = _merged(_intervals(e for e in complete if e.get("cat") == "overhead"))
    profiler = sum(max(0.0, min(o_end, g.end) - max(o_start, g.start)) for g in idle for o_start, o_end in overhead)
    idle.sort(key=lambda g: -g.us)
    span = spans[-1][1] - spans[0][0]
    # Host events longer than half the device's span (a step's own annotation) cover every gap and name none.
    host = [e for e in complete if e.get("cat") in HOST_CATEGORIES and float(e.get("dur", 0.0)) <= span / 2]
    for gap in idle[:top]:
        overlap = []
        for e in host:
            start, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
            us = min(end, gap.end) - max(start, gap.start)
            if us > 0:
                overlap.append((str(e.get("name", "?"))[:60], us, e.get("tid")))
        overlap.sort(key=lambda o: -o[1])
        gap.host = overlap
    return GapReport(span, busy, copies, idle[:top], profiler_us=profiler, origin_us=spans[0][0])


def load(path: str) -> dict[str, Any]:
    """A Chrome trace from ``path`` (``.json`` or ``.json.gz``)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not a Chrome trace (JSON): {exc}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_gaps", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", help="a torch.profiler Chrome trace (.json or .json.gz)")
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args(argv)
    try:
        report = gpu_gaps(load(args.trace), top=args.top)
    except (OSError, ValueError) as exc:
        parser.exit(1, f"python -m bench.gpu_gaps: {exc}\n")
    from bench import core

    core.print_results(report.keys(), False)
    for line in report.lines(args.top):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
