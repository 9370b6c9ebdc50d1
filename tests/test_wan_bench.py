"""``python -m bench.wan`` at a tiny size: two network namespaces, a tbf-shaped veth pair, a trunk server process in
one and the client in the other. Needs root, ``ip netns`` and ``tc`` (skipped with the reason otherwise)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.wan import SKIP_EXIT, parse_rate

ROOT = Path(__file__).resolve().parent.parent
QUICK = ["--quick", "--models", "mnist-cnn", "--rates", "100mbit", "--steps", "2", "--warmup", "1"]


def _bench(*args: str) -> list[str]:
    return [sys.executable, "-m", "bench.wan", *args]


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30,
                            check=False).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def _skip_unless_it_ran(done: subprocess.CompletedProcess[str]) -> None:
    if done.returncode == SKIP_EXIT:
        pytest.skip(done.stderr.strip())


def test_rates_parse() -> None:
    assert parse_rate("100mbit") == 100e6
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("2.5mbit") == 2.5e6
    assert parse_rate("unshaped") is None
    with pytest.raises(ValueError, match="like 100mbit"):
        parse_rate("100MB")


@pytest.mark.timeout(120)
def test_tiny_run_reports_bytes_and_removes_its_namespaces() -> None:
    done = subprocess.run(_bench(*QUICK, "--json"), cwd=ROOT, capture_output=True, text=True, timeout=110,
                          check=False)
    _skip_unless_it_ran(done)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    by = {r["compression"]: r for r in report["results"]}
    assert set(by) == {"none", "int8", "topk"}
    for r in by.values():
        assert r["payload_bytes_per_step"] > 0 and r["link_bytes_per_step"] > 0 and r["step_ms"] > 0
        assert r["link_bytes_per_step"] >= r["payload_bytes_per_step"]  # framing and TCP/IP headers on top
    assert by["int8"]["payload_bytes_per_step"] < by["none"]["payload_bytes_per_step"]
    assert by["int8"]["link_bytes_per_step"] < by["none"]["link_bytes_per_step"]
    assert 5 < by["none"]["link_mb_s"] < 13  # 100 Mbit/s is 12.5 MB/s
    assert report["namespaces_left"] is False
    assert not set(report["namespaces"]) & _namespaces()


@pytest.mark.timeout(120)
def test_terminated_run_removes_its_namespaces_and_processes() -> None:
    proc = subprocess.Popen(_bench(*QUICK, "--steps", "50"), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    names = {f"sfwan{proc.pid}s", f"sfwan{proc.pid}c"}
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None and not started:
            if names <= _namespaces():  # the trunk server has started inside the server namespace
                listed = subprocess.run(["ip", "netns", "pids", f"sfwan{proc.pid}s"], capture_output=True,
                                        text=True, timeout=30, check=False).stdout
                started = {int(pid) for pid in listed.split()}
            time.sleep(0.2)
        if proc.poll() == SKIP_EXIT:
            pytest.skip(proc.stderr.read().strip())  # type: ignore[union-attr]
        assert started, f"no trunk server started: {proc.stderr.read() if proc.poll() is not None else ''}"  # type: ignore[union-attr]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert not names & _namespaces()
    for pid in started:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
