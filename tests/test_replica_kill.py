"""A trunk replica that dies is an expected event: rank 0 says so in one WARNING line (which replica, how it ended,
what happens now), with no ERROR and no traceback (gloo's "Connection reset by peer" and its stack are at DEBUG),
in the library's log and in what ``splitfed serve --replicas 2`` prints."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVE = ["serve", "--model", "mnist-cnn", "--replicas", "2", "--port", "0", "--insecure"]
LOST = "trunk replica 1 ended (killed by SIGKILL)"


def test_a_killed_replica_is_one_warning_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    from splitfed.cli.main import _build_server, build_parser
    from splitfed.run.launcher import ReplicaSet

    args = build_parser().parse_args(SERVE)
    args.authenticate, args.model = None, args.model[0]  # as `splitfed serve` sets them for one model
    server = _build_server(0, args).start()
    rs = None
    try:
        rs = ReplicaSet(server, 2, _build_server, (args,), timeout_s=120.0).start()  # spawning is slow when busy
        assert rs.group is not None and rs.group._thread is not None
        caplog.set_level(logging.INFO, logger="splitfed")
        caplog.clear()
        rs._context.processes[0].kill()
        rs.group._thread.join(60)  # the control loop ends after reporting the break
        assert not rs.group.active and rs.gone(1) and not rs.gone(0)
        rs.stop()
    finally:
        if rs is not None:
            rs.stop()
        server.stop(grace=0)
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [(r.levelname, r.name) for r in loud] == [("WARNING", "splitfed.run.launcher")], \
        [f"{r.levelname} {r.name}: {r.getMessage()}" for r in loud]
    assert LOST in loud[0].getMessage() and loud[0].exc_info is None
    assert "\n" not in loud[0].getMessage()


def _replica_pid(parent: int) -> int:
    """The spawned replica among ``parent``'s children (not multiprocessing's resource tracker)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"spawn_main" in cmdline:
            return int(entry.name)
    raise AssertionError(f"no spawned replica under process {parent}")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the replica's process in /proc")
def test_killing_a_replica_of_splitfed_serve_prints_one_warning_line() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "splitfed.cli", *SERVE], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines: list[str] = []
    serving, down = threading.Event(), threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "serving the trunk of" in line:
                serving.set()
            if "is down" in line:
                down.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert serving.wait(180), "".join(lines)
        os.kill(_replica_pid(proc.pid), signal.SIGKILL)
        assert down.wait(30), "".join(lines)  # the router noticed too
        time.sleep(1.0)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        reader.join(10)
    text = "".join(lines)
    warnings = [line for line in lines if " WARNING " in line]
    assert len(warnings) == 1 and LOST in warnings[0], text
    assert " ERROR " not in text and "Traceback" not in text, text
