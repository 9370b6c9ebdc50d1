"""``flwr run . local`` for benchmarks: a private ``FLWR_HOME`` and ports, a bounded wait, the processes it leaves
(the local SuperLink, Ray) ended by PID, and a run that did not complete reported as a failure."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from bench.processes import BenchError
from splitfed.run.rundirs import HISTORY, latest_run

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
#: What Ray says when its raylet or GCS missed a fixed start-up window, and what ``flwr`` says when its local
#: SuperLink missed its 15 s one (a loaded machine, not splitfed).
RAY_START_FLAKES = ("timed out during startup", "Timed out waiting for file", "Failed to start local SuperLink")
#: The federation of the main job: 4 SuperNodes, one CPU each.
FEDERATION = "client-resources-num-cpus=1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FlowerRuns:
    """Runs of ``flwr run <app> local`` in one private FLWR_HOME (``home``; default: a temporary folder, removed on
    :meth:`close`), on ports of its own; :meth:`close` ends the processes they left, by PID."""

    def __init__(self, home: Path | None = None) -> None:
        self._own_home = home is None
        self.home = Path(tempfile.mkdtemp(prefix="flwr-home-")) if home is None else home
        self.home.mkdir(parents=True, exist_ok=True)
        self.ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
        self.env = dict(os.environ, FLWR_HOME=str(self.home), FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
                        FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1", RAY_TMPDIR=self.ray_tmp,
                        FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(_free_port()),
                        FLWR_LOCAL_CONTROL_API_PORT=str(_free_port()),
                        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")

    def run(self, overrides: str, out: Path, *, supernodes: int = 4, federation: str = FEDERATION,
            app: str | Path = ".", timeout: float = 3600) -> dict[str, Any]:
        """One run of ``app`` with run-config ``overrides`` (``output-dir`` is ``out``: the run writes its own folder
        there, ``<time>-run<id>``, and points ``out/latest`` at it); returns that run's history (its folder in
        ``run-dir``), whose ``status`` says whether it completed (``failed``, with the run's output in ``error``,
        when it wrote none).
        A run whose Ray or local SuperLink missed its start-up window (it happens on a loaded machine and says
        nothing about splitfed) is retried once; one that outlives ``timeout`` seconds is killed and reported failed."""
        cmd = [str(BIN / "flwr"), "run", str(app), "local", "--stream", "--run-config",
               f"{overrides} output-dir='{out}'", "--federation-config", f"num-supernodes={supernodes} {federation}"]
        started = time.time()
        output = ""
        path: Path | None = None
        for attempt in range(2):
            try:
                result = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout,
                                        check=False)
            except subprocess.TimeoutExpired as exc:
                return {"status": "failed", "rounds": [], "error": f"flwr run did not end within {timeout:.0f} s; "
                        f"its output ends:\n{_text(exc.stdout)[-2000:]}{_text(exc.stderr)[-2000:]}"}
            output = result.stdout + result.stderr
            path = _new_history(out, started)
            if path is not None or not any(f in output for f in RAY_START_FLAKES) or attempt:
                break
            time.sleep(5)
        if path is None:
            return {"status": "failed", "rounds": [], "error": f"flwr run wrote no history in a new run folder of "
                                                               f"{out}; its output ends:\n{output[-3000:]}"}
        return {**json.loads(path.read_text()), "run-dir": str(path.parent)}

    def close(self) -> None:
        """End the SuperLink, Ray and anything else started under this FLWR_HOME, children first."""
        try:
            from bench.processes import end_processes_of

            end_processes_of(str(self.home), self.ray_tmp)
        except ImportError:  # pragma: no cover - psutil comes with the test extra
            sys.stderr.write(f"psutil is missing: end the processes of FLWR_HOME={self.home} yourself\n")
        shutil.rmtree(self.ray_tmp, ignore_errors=True)
        if self._own_home:
            shutil.rmtree(self.home, ignore_errors=True)

    def __enter__(self) -> FlowerRuns:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
                 ) -> None:
        self.close()


def _new_history(out: Path, since: float) -> Path | None:
    """The history in the run folder that ``out/latest`` points at, if it was written at ``since`` or later (by
    this run: a fresh run's folder, or the folder a resumed run writes on in)."""
    run = latest_run(out)
    path = None if run is None else run / HISTORY
    return path if path is not None and path.is_file() and path.stat().st_mtime >= since - 1 else None


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def completed(history: dict[str, Any], what: str) -> dict[str, Any]:
    """``history`` if its run completed; else :class:`BenchError` with the run's error."""
    if history.get("status") != "completed":
        raise BenchError(f"{what} did not complete (status {history.get('status')!r}): {history.get('error', '')}")
    return history


def flwr_run(overrides: str, out: Path, supernodes: int = 4, *, federation: str = FEDERATION, app: str | Path = ".",
             timeout: float = 3600) -> dict[str, Any]:
    """One ``flwr run . local`` with run-config ``overrides`` on a SuperLink of its own (ended afterwards); returns
    its history.

    Raises:
        BenchError: the run did not complete (or wrote no history, or outlived ``timeout``); the message quotes its
            error.
    """
    with FlowerRuns() as flower:
        history = flower.run(overrides, out, supernodes=supernodes, federation=federation, app=app, timeout=timeout)
    return completed(history, f"flwr run with {overrides!r}")
