"""The trunk throughput benchmarks' commands (``bench.trunk``, ``bench.trunk_runtime``, ``bench.timeline_plot``) run
on the CPU at a tiny size and exit 0 with their figures; the figures mean nothing (a shared machine, a tiny model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = "layers=3 hidden=32 heads=2 vocab=64 batch=1 seq=8"  # bench.core's SPLIT_STEP keys


def _bench(module: str, *args: str, timeout: float = 300) -> str:
    """``python -m <module> <args>`` from the repository root; returns its stdout, asserting exit code 0."""
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert done.returncode == 0, f"{module} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done.stdout


def test_bench_trunk_on_the_cpu(tmp_path: Path) -> None:
    timeline = tmp_path / "timeline.json"
    results = json.loads(_bench("bench.trunk", "--device", "cpu", "--clients", "2", "--repeat", "1", "--steps", "2",
                                "--only", "one", "batched", "--config", TINY, "--timeline", str(timeline),
                                "--json").strip().splitlines()[-1])
    assert results["trunk_examples_per_s_2_clients_cpu"] > 0 and results["trunk_batching_speedup_cpu"] > 0
    assert timeline.stat().st_size > 0


def test_bench_trunk_runtime() -> None:
    results = json.loads(_bench("bench.trunk_runtime", "--clients", "2", "--steps", "1", "--config", TINY,
                                "--json").strip().splitlines()[-1])
    assert results["runtime_ceiling_fraction_2"] > 0


def test_bench_timeline_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    _bench("bench.timeline_plot", str(ROOT / "docs" / "img" / "trunk_timeline_after.json"), str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 0


@pytest.mark.parametrize("mode", ["async", pytest.param("quorum", marks=pytest.mark.slow)])
def test_bench_trunk_in_other_modes(mode: str) -> None:
    """``--mode`` runs the batched clients against an async or quorum trunk; its keys carry the mode."""
    results = json.loads(_bench("bench.trunk", "--device", "cpu", "--clients", "2", "--repeat", "1", "--steps", "2",
                                "--only", "batched", "--mode", mode, "--window-ms", "5", "--config", TINY,
                                "--json").strip().splitlines()[-1])
    assert results[f"trunk_examples_per_s_2_clients_batched_{mode}_cpu"] > 0 and results["mode"] == mode
