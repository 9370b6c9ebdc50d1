"""bench.gpu_gaps: a trace's GPU busy time, its idle gaps and the host work in each (on traces written here)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_gaps import gpu_gaps

ROOT = Path(__file__).resolve().parents[1]


def _event(cat: str, name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}


def _trace() -> dict:
    """Device: kernels 100-200 and 150-300 (overlapping: one span), a copy 1300-1400, kernels 1450-1500 and
    2400-2500. Host: a copy 250-1350 (covers the 1000 us gap), an op 1390-1460 (the 50 us gap), a launch
    1800-2400 (600 us of the 900 us gap), a step-long annotation, and the profiler's overhead 1420-1430."""
    return {"traceEvents": [
        _event("kernel", "gemm", 100, 100), _event("kernel", "norm", 150, 150),
        _event("gpu_memcpy", "Memcpy HtoD", 1300, 100), _event("kernel", "add", 1450, 50),
        _event("kernel", "gelu", 2400, 100), _event("cpu_op", "cudaLaunchKernel", 1800, 600, tid=9),
        _event("cpu_op", "aten::copy_", 250, 1100, tid=7), _event("python_function", "bring", 1390, 70, tid=8),
        _event("user_annotation", "ProfilerStep", 0, 5e6, tid=7),
        _event("overhead", "Activity Buffer Request", 1420, 10, tid=0),  # the profiler's own, inside a gap
        {"ph": "i", "name": "marker", "ts": 400},  # not a complete event: ignored
    ]}


def test_busy_idle_and_copies_are_the_device_spans() -> None:
    report = gpu_gaps(_trace())
    assert report.span_us == 2400  # 100 .. 2500
    assert report.busy_us == 200 + 100 + 50 + 100  # 100-300 merged, the copy, the last two kernels
    assert report.copy_us == 100
    assert report.busy_fraction == pytest.approx(450 / 2400)
    keys = report.keys()
    assert keys["trace_gpu_idle_ms"] == pytest.approx(1.95)
    assert keys["trace_gpu_copy_ms"] == pytest.approx(0.1)
    assert keys["trace_gpu_idle_profiler_ms"] == pytest.approx(0.01)


def test_gaps_longest_first_with_the_host_work_overlapping_them() -> None:
    report = gpu_gaps(_trace())
    assert [(g.start, g.end) for g in report.gaps] == [(300, 1300), (1500, 2400), (1400, 1450)]
    first, second, third = report.gaps
    assert first.host == [("aten::copy_", 1000, 7)]  # the step-long annotation is not named
    assert second.host == [("cudaLaunchKernel", 600, 9)]
    assert [h[0] for h in third.host] == ["bring", "Activity Buffer Request"]
    assert third.host[0][1] == pytest.approx(50)
    assert report.lines()[0].startswith("idle 1.00 ms at 0.20 ms: aten::copy_ 1.00")


def test_small_gaps_and_top_are_honoured() -> None:
    assert [g.us for g in gpu_gaps(_trace(), min_gap_us=60).gaps] == [1000, 900]
    assert len(gpu_gaps(_trace(), top=1).gaps) == 1


def test_a_trace_without_device_work_is_an_error() -> None:
    with pytest.raises(ValueError, match="no GPU kernel"):
        gpu_gaps({"traceEvents": [_event("cpu_op", "aten::mm", 0, 10)]})


def test_the_command_reads_a_gzipped_trace_and_fails_on_a_cpu_one(tmp_path: Path) -> None:
    good, bad = tmp_path / "step.json.gz", tmp_path / "cpu.json"
    with gzip.open(good, "wt") as f:
        json.dump(_trace(), f)
    bad.write_text(json.dumps({"traceEvents": [_event("cpu_op", "aten::mm", 0, 10)]}))
    run = [sys.executable, "-m", "bench.gpu_gaps"]
    ok = subprocess.run([*run, str(good)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "trace_gpu_busy_ms" in ok.stdout and "0.45" in ok.stdout and "idle 1.00 ms" in ok.stdout
    failed = subprocess.run([*run, str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1 and "no GPU kernel" in failed.stderr
