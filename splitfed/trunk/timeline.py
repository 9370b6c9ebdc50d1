"""A timeline of the trunk server's work: when calls arrive and leave, batches close, the device thread and the GPU
are busy.

Off by default and then free (one attribute test per mark). Turned on, every
mark is a tuple appended to a list under a lock (about a microsecond); GPU spans
record two CUDA events on the current stream, resolved to host time once the
recording stops, so recording never makes the host wait for the GPU.

Kinds of mark (``client`` names the caller where there is one):

* ``forward-in`` / ``forward-out``, ``backward-in`` / ``backward-out``: a call's
  handler started (its bytes parsed) and its reply was ready to send;
* ``window``: a batch of ``n`` forwards closed, ``waited`` seconds after its first
  arrived;
* ``step``: the trunk took an optimizer step;
* spans (begin and end): ``host`` work on a thread (``what`` says which, ``thread``
  which thread), ``gpu`` work on the device's stream, and ``gc``: a collection of
  Python's garbage collector (``generation``, ``collected``) in this process, which
  holds every thread of it still while it runs.

Pure Python and torch; :func:`summarize` turns a recording into the figures
``python -m bench.trunk --timeline`` prints.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import itertools
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

#: What :meth:`Timeline.host` and :meth:`Timeline.gpu` give while nothing is recorded (one object, no allocation).
_IDLE: contextlib.AbstractContextManager[None] = contextlib.nullcontext()


@dataclass
class _GpuSpan:
    what: str
    begin: Any
    end: Any
    info: dict[str, Any]


@dataclass
class Timeline:
    """Records marks and spans while :attr:`enabled`; :meth:`events` gives them in seconds since :meth:`start`."""

    enabled: bool = False
    _marks: list[tuple[float, str, str, str, dict[str, Any]]] = field(default_factory=list)
    _gpu: list[_GpuSpan] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _t0: float = 0.0
    _ref: Any = None  # a CUDA event recorded at ``_t0`` (host and GPU clocks aligned there)
    _device: torch.device | None = None
    _gc_began: float = 0.0
    _collections: list[tuple[float, float, str, int, int]] = field(default_factory=list)

    def start(self, device: torch.device | str | None = None) -> None:
        """Clear and start recording; with a CUDA ``device``, GPU spans are recorded too."""
        dev = torch.device(device) if device is not None else None
        with self._lock:
            self._marks, self._gpu, self._collections = [], [], []
            self._device = dev if dev is not None and dev.type == "cuda" else None
            if self._device is not None:
                torch.cuda.synchronize(self._device)
                self._ref = torch.cuda.Event(enable_timing=True)
                self._ref.record(torch.cuda.current_stream(self._device))
                torch.cuda.synchronize(self._device)
            self._t0 = time.perf_counter()
            self.enabled = True
            if self._collected not in gc.callbacks:
                gc.callbacks.append(self._collected)

    @property
    def origin(self) -> float:
        """The ``time.perf_counter`` reading that time 0 of the recording stands for (on Linux, CLOCK_MONOTONIC:
        other processes' readings of it fit the same timeline)."""
        return self._t0

    def stop(self) -> list[dict[str, Any]]:
        """Stop recording; returns :meth:`events` (waits for the GPU spans to finish)."""
        self.enabled = False
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._collected)
        return self.events()

    def _collected(self, phase: str, info: dict[str, int]) -> None:
        """``gc.callbacks`` hook: a collection's span (the collector holds the GIL throughout, so one at a time)."""
        # No lock here: a collection can start inside any allocation, such as the one :meth:`mark` makes holding
        # the lock. ``list.append`` is atomic, and no collection starts while one runs.
        now = time.perf_counter()
        if phase == "start":
            self._gc_began = now
        elif self.enabled and self._gc_began:
            self._collections.append((self._gc_began, now, threading.current_thread().name,
                                      info.get("generation", -1), info.get("collected", 0)))

    # -- recording ----------------------------------------------------------------------------
    def mark(self, kind: str, client: str = "", **info: Any) -> None:
        """Record that ``kind`` happened now (for ``client``)."""
        if not self.enabled:
            return
        now = time.perf_counter()
        with self._lock:
            self._marks.append((now, kind, client, threading.current_thread().name, info))

    def host(self, what: str, **info: Any) -> contextlib.AbstractContextManager[None]:
        """A span of host work on the calling thread (while not recording, a shared no-op: it runs on every call)."""
        return self._host(what, info) if self.enabled else _IDLE

    @contextlib.contextmanager
    def _host(self, what: str, info: dict[str, Any]) -> Iterator[None]:
        begin = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            with self._lock:
                self._marks.append((begin, "host", "", threading.current_thread().name,
                                    dict(info, what=what, end=end)))

    def gpu(self, what: str, **info: Any) -> contextlib.AbstractContextManager[None]:
        """A span of GPU work: what the block queues on the device's current stream."""
        device = self._device
        return self._gpu_span(device, what, info) if self.enabled and device is not None else _IDLE

    @contextlib.contextmanager
    def _gpu_span(self, device: torch.device, what: str, info: dict[str, Any]) -> Iterator[None]:
        stream = torch.cuda.current_stream(device)
        begin = torch.cuda.Event(enable_timing=True)
        begin.record(stream)
        try:
            yield
        finally:
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(device))
            with self._lock:
                self._gpu.append(_GpuSpan(what, begin, end, info))

    # -- reading ---------------------------------------------------------------------------
    def events(self) -> list[dict[str, Any]]:
        """Every mark and span, ordered by time, in seconds since :meth:`start`."""
        with self._lock:
            marks, gpu, t0 = list(self._marks), list(self._gpu), self._t0
        marks += [(begin, "gc", "", thread, {"end": end, "generation": generation, "collected": collected})
                  for begin, end, thread, generation, collected in list(self._collections)]
        out: list[dict[str, Any]] = []
        for t, kind, client, thread, info in marks:
            event = {"t": t - t0, "kind": kind, "client": client, "thread": thread}
            event.update(info)
            if "end" in info:
                event["end"] = info["end"] - t0
            out.append(event)
        if gpu and self._device is not None:
            torch.cuda.synchronize(self._device)
            for span in gpu:
                begin = self._ref.elapsed_time(span.begin) / 1000.0
                end = self._ref.elapsed_time(span.end) / 1000.0
                out.append({"t": begin, "end": end, "kind": "gpu", "client": "", "thread": "gpu",
                            "what": span.what, **span.info})
        return sorted(out, key=lambda e: e["t"])


#: The process's timeline; servers and runtimes record into it when it is enabled.
TIMELINE = Timeline()


def _union(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by at least one of ``spans``."""
    total, reach = 0.0, lo
    for begin, end in sorted(spans):
        begin, end = max(begin, reach), min(end, hi)
        if end > begin:
            total += end - begin
            reach = end
    return total


def summarize(events: list[dict[str, Any]], lo: float | None = None, hi: float | None = None) -> dict[str, float]:
    """Figures of the recording between ``lo`` and ``hi`` (default: all of it), in milliseconds and shares.

    ``*_first`` / ``*_last``: when the first and last call of each kind arrived or left; ``host_busy_<thread>``:
    the share of the interval each thread spent in host spans; ``gpu_busy``: the share with GPU work queued and
    running (from CUDA events: launch gaps inside a span count as busy); ``gc_*``: the garbage collector's
    collections (count, total and longest milliseconds, and how many were full ones, generation 2).
    """
    if not events:
        return {}
    lo = min(e["t"] for e in events) if lo is None else lo
    hi = max(e.get("end", e["t"]) for e in events) if hi is None else hi
    span = max(hi - lo, 1e-9)
    inside = [e for e in events if lo <= e["t"] <= hi]
    out: dict[str, float] = {"interval_ms": span * 1e3}
    for kind in ("forward-in", "forward-out", "backward-in", "backward-out", "client-forward-sent",
                 "client-backward-sent", "client-backward-got"):
        times = [e["t"] for e in inside if e["kind"] == kind]
        if times:
            key = kind.replace("-", "_")
            out[f"{key}_first_ms"] = (min(times) - lo) * 1e3
            out[f"{key}_last_ms"] = (max(times) - lo) * 1e3
            out[f"{key}_count"] = float(len(times))
    windows = [e for e in inside if e["kind"] == "window"]
    if windows:
        out["windows"] = float(len(windows))
        out["window_waited_ms"] = sum(e.get("waited", 0.0) for e in windows) * 1e3
    threads: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e["kind"] == "host":
            threads.setdefault(e["thread"], []).append((e["t"], e["end"]))
    for thread, spans in threads.items():
        out[f"host_busy_{thread}"] = _union(spans, lo, hi) / span
    collections = [e for e in inside if e["kind"] == "gc"]
    if collections:
        out["gc_count"] = float(len(collections))
        out["gc_full_count"] = float(sum(e.get("generation") == 2 for e in collections))
        out["gc_ms"] = sum(e["end"] - e["t"] for e in collections) * 1e3
        out["gc_longest_ms"] = max(e["end"] - e["t"] for e in collections) * 1e3
    gpu = [(e["t"], e["end"]) for e in events if e["kind"] == "gpu"]
    if gpu:
        out["gpu_busy"] = _union(gpu, lo, hi) / span
        out["gpu_ms"] = _union(gpu, lo, hi) * 1e3
    return out


def step_lengths(events: list[dict[str, Any]], long_factor: float = 1.5) -> dict[str, float]:
    """The recording's trunk steps (from one ``step`` mark to the next), in milliseconds: their median, mean and
    longest; ``long_steps``: how many took more than ``long_factor`` times the median, ``long_steps_with_gc``: how
    many of those a garbage collection of 5 ms or more fell in; ``run_gc_*``: the collector over all the steps."""
    steps = sorted(e["t"] for e in events if e["kind"] == "step")
    if len(steps) < 2:
        return {}
    spans = list(itertools.pairwise(steps))
    lengths = sorted(b - a for a, b in spans)
    median = lengths[len(lengths) // 2]
    collections = [(e["t"], e["end"]) for e in events if e["kind"] == "gc"]
    long = [(a, b) for a, b in spans if b - a > long_factor * median]
    out = {"steps": float(len(lengths)), "step_median_ms": median * 1e3,
           "step_mean_ms": sum(lengths) / len(lengths) * 1e3, "step_longest_ms": lengths[-1] * 1e3,
           "long_steps": float(len(long)),
           "long_steps_with_gc": float(sum(any(g0 < b and g1 > a and g1 - g0 >= 5e-3 for g0, g1 in collections)
                                           for a, b in long))}
    whole = summarize([e for e in events if e["kind"] == "gc"], steps[0], steps[-1])
    out.update({f"run_{k}": v for k, v in whole.items() if k.startswith("gc_")})
    return out


#: The hops :func:`hops` times: (name, the mark it starts at, the mark it ends at), both marks of one client.
_CLIENT_HOPS = (
    ("forward_sent_to_in", "client-forward-sent", "forward-in"),  # the client's encoding, the channel, the intake
    ("backward_sent_to_in", "client-backward-sent", "backward-in"),
    ("forward_out_to_backward_sent", "forward-out", "client-backward-sent"),  # the reply's way back, the client's turn
    ("backward_out_to_got", "backward-out", "client-backward-got"),
)


def hops(events: list[dict[str, Any]]) -> dict[str, float]:
    """Where a sync step's time goes between the marks, over every step of a recording.

    Each figure is a median (the upper of the middle two), with its 90th percentile as ``_p90``, in milliseconds:
    each call's hops between a client and the engine (``hop_<name>``, from the client's marks and the server's:
    one clock for every process on Linux); the gap between two Forwards the engine's handlers take in one after
    the other (``hop_intake_gap``); and the server's hand-overs around the GPU in each step: from a window's close
    to the GPU's forward (``hop_window_to_gpu``), from the GPU's forward to the first and last Forward reply
    (``hop_gpu_to_first_reply``, ``hop_gpu_to_last_reply``), from the last gradient in to the GPU's backward
    (``hop_last_gradient_to_gpu``), from the GPU's backward to its optimizer step (``hop_backward_to_step``), and
    that split at the moment the step's last gradient is offered to the aggregator, after the gradient guard's
    check (``hop_backward_to_offer``, ``hop_offer_to_step``: to the step's mark).

    A replica of a group (:mod:`splitfed.trunk.replicas.group`) adds its control loop's part: from entering its first
    tick with all its gradients in to its step (``hop_replica_ready_to_step``), how long of that it waited in the
    group's collectives for the other replicas (``hop_replica_ready_wait``), and its ticks in a step
    (``replica_ticks_per_step``, a median) and vetoed step proposals over the recording (``replica_vetoes``).
    """
    from splitfed.trunk.replicas.aggregation import READY

    ordered = sorted(events, key=lambda e: e["t"])
    times = [e["t"] for e in ordered]
    steps = [e["t"] for e in ordered if e["kind"] == "step"]
    found: dict[str, list[float]] = {}
    ticks_per_step: list[int] = []

    def add(name: str, seconds: float) -> None:
        found.setdefault(name, []).append(seconds * 1e3)

    for lo, hi in itertools.pairwise(steps):
        inside = ordered[bisect.bisect_left(times, lo): bisect.bisect_left(times, hi)]
        marks: dict[str, dict[str, float]] = {}
        for e in inside:
            if e.get("client") and "end" not in e:
                marks.setdefault(e["client"], {})[e["kind"]] = e["t"]
        for name, start, end in _CLIENT_HOPS:
            for seen in marks.values():
                if start in seen and end in seen:
                    add(name, seen[end] - seen[start])
        arrivals = sorted(e["t"] for e in inside if e["kind"] == "forward-in")
        for a, b in itertools.pairwise(arrivals):
            add("intake_gap", b - a)
        gpu = {e["what"]: e for e in inside if e["kind"] == "gpu"}
        windows = [e["t"] for e in inside if e["kind"] == "window"]
        replies = [e["t"] for e in inside if e["kind"] == "forward-out"]
        gradients = [e["t"] for e in inside if e["kind"] == "backward-in"]
        forward, backward, step = gpu.get("forward"), gpu.get("backward"), gpu.get("step")
        if forward is not None and len(windows) == 1:  # one batch in the step: its window, its forward
            add("window_to_gpu", forward["t"] - windows[0])
            if replies:
                add("gpu_to_first_reply", min(replies) - forward["end"])
                add("gpu_to_last_reply", max(replies) - forward["end"])
        if backward is not None and gradients:
            add("last_gradient_to_gpu", backward["t"] - max(gradients))
            if step is not None and step["t"] >= backward["end"]:  # the step's GPU work starts before its mark
                add("backward_to_step", step["t"] - backward["end"])
            offers = [e["t"] for e in inside if e["kind"] == "offer" and e["t"] >= backward["end"]]
            if offers:
                add("backward_to_offer", offers[-1] - backward["end"])
                add("offer_to_step", hi - offers[-1])
        ticks = [e for e in inside if e["kind"] == "replica-tick"]
        if ticks:
            ticks_per_step.append(len(ticks))
            ready = [e for e in ticks if e["own"] == READY]
            if ready:
                votes = [e for e in inside if e["kind"] == "replica-vote" and e["t"] >= ready[0]["t"]]
                add("replica_ready_to_step", hi - (ready[0]["t"] - ready[0]["waited"]))
                add("replica_ready_wait", sum(e["waited"] for e in ready + votes))
    out: dict[str, float] = {}
    if ticks_per_step:
        ticks_per_step.sort()
        out["replica_ticks_per_step"] = ticks_per_step[len(ticks_per_step) // 2]
        out["replica_vetoes"] = sum(e.get("vetoed", 0) for e in ordered if e["kind"] == "replica-vote")
    for name, values in found.items():
        values.sort()
        out[f"hop_{name}_ms"] = values[len(values) // 2]
        out[f"hop_{name}_p90_ms"] = values[min(len(values) - 1, (9 * len(values)) // 10)]
    return out


def save(events: list[dict[str, Any]], path: str | Path) -> None:
    """Write a recording as JSON (one object per event)."""
    Path(path).write_text(json.dumps(events, indent=None, separators=(",", ":")) + "\n")
