"""End to end through Flower's own tooling: ``flwr run . local`` simulations in every trunk mode, and a
deployment with ``flower-superlink`` and two ``flower-supernode``s on loopback. Slow (Ray, processes):
``python -m pytest -q -m slow`` (CI's real ``flwr run`` is ``tests/test_e2e_tls.py``'s). Every process a test starts
is ended by the test, by PID."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from flower_harness import run_folder

from bench.processes import end_processes_of

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
#: What Ray says when its raylet did not register, or its GCS server did not write its port, within their fixed
#: start-up windows (30 s): a loaded 2-core machine, nothing of splitfed's.
RAY_START_FLAKES = ("timed out during startup", "Timed out waiting for file")
SUPERLINK_START_FLAKE = "Failed to start local SuperLink"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(home: Path) -> dict[str, str]:
    # Ray's unix sockets live under RAY_TMPDIR, and their paths must stay under 108 bytes.
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    (home / "ray-tmpdir").write_text(ray_tmp)
    # `flwr run . local` starts its own SuperLink on these ports (defaults 39091/39093, shared by every
    # FLWR_HOME on the machine): free ones keep each test on its own SuperLink.
    return dict(os.environ, FLWR_HOME=str(home), FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
                FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1", RAY_TMPDIR=ray_tmp,
                FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(_free_port()), FLWR_LOCAL_CONTROL_API_PORT=str(_free_port()),
                PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")


def _kill_tree_matching(marker: str) -> None:
    """End every process whose command line mentions ``marker`` (our FLWR_HOME), children first."""
    end_processes_of(marker)


@pytest.fixture
def flwr_home(tmp_path: Path) -> Iterator[Path]:
    home = tmp_path / "flwr-home"
    home.mkdir()
    yield home
    _kill_tree_matching(str(home))
    marker = home / "ray-tmpdir"
    if marker.exists():
        ray_tmp = marker.read_text()
        _kill_tree_matching(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)


# `flwr run . local` starts a local SuperLink and gives it a fixed 15 s to answer (flwr.cli.local_superlink); on a
# loaded 2-core machine it can take longer ("Failed to start local SuperLink within 15s"), and the run never starts.
# start_local_superlink() starts the same SuperLink with Flower's own code, waiting up to this long.
LOCAL_SUPERLINK_START_S = 300.0
_START_LOCAL_SUPERLINK = """
import sys
import httpx
from flwr.cli import local_superlink
from flwr.cli.constant import LOCAL_SUPERLINK_HTTP_API_PORT

try:
    up = httpx.get(f"http://127.0.0.1:{LOCAL_SUPERLINK_HTTP_API_PORT}/health", timeout=30).is_success
except httpx.HTTPError:
    up = False
if not up:
    local_superlink.LOCAL_SUPERLINK_STARTUP_TIMEOUT = float(sys.argv[1])
    local_superlink._start_local_superlink()
"""


def start_local_superlink(env: dict[str, str]) -> None:
    """Start the local SuperLink of ``env``'s FLWR_HOME and ports, as ``flwr run . local`` would, unless it runs."""
    subprocess.run([sys.executable, "-c", _START_LOCAL_SUPERLINK, str(LOCAL_SUPERLINK_START_S)], cwd=ROOT, env=env,
                   check=True, capture_output=True, timeout=LOCAL_SUPERLINK_START_S + 60)


def flwr_run(args: list[str], env: dict[str, str]) -> str:
    """``flwr run ...``; returns its output. The local SuperLink is started first (see
    :func:`start_local_superlink`). Retried once when Ray's raylet or GCS server missed its start-up window, or when
    ``flwr`` took the (busy) SuperLink for absent (it probes for 0.4 s); both happen on a loaded 2-core machine and
    say nothing about splitfed."""
    for attempt in range(2):
        if len(args) > 1 and args[1] == "local":
            start_local_superlink(env)
        result = subprocess.run([str(BIN / "flwr"), "run", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=900)
        output = result.stdout + result.stderr
        flake = any(m in output for m in (*RAY_START_FLAKES, SUPERLINK_START_FLAKE))
        if not flake or attempt:
            return output
        time.sleep(5)
    raise AssertionError("unreachable")


def _run_id(output: str) -> str:
    match = re.search(r"run_id `?(\d+)", output) or re.search(r"run ID:? `?(\d+)", output)
    assert match, f"no run id in flwr output:\n{output[-3000:]}"
    return match.group(1)


def _status(connection: str, run_id: str, env: dict[str, str]) -> str:
    out = subprocess.run([str(BIN / "flwr"), "list", connection, "--run-id", run_id, "--format", "json"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    runs = json.loads(out.stdout)["runs"]
    return runs[0]["status"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async", "quorum"])
def test_flwr_run_simulation_completes_in_every_trunk_mode(flwr_home: Path, tmp_path: Path, mode: str) -> None:
    env = _env(flwr_home)
    out_dir = tmp_path / "outputs"
    overrides = (f"trunk-mode='{mode}' quorum=2 num-server-rounds=2 local-steps=10 output-dir='{out_dir}'")
    output = flwr_run([".", "local", "--stream", "--run-config", overrides, "--federation-config",
                       "num-supernodes=4 client-resources-num-cpus=1"], env)
    run_id = _run_id(output)
    # `flwr run --stream` exits 0 even when the run failed: ask the SuperLink.
    assert _status("local", run_id, env) == "finished:completed", output[-3000:]
    history = json.loads((run_folder(out_dir) / "history.json").read_text())
    assert [r["round"] for r in history["rounds"]] == [1, 2]
    assert history["rounds"][-1]["train"]["train-steps"] == 40
    assert history["rounds"][-1]["trunk"]["trunk-steps"] > 0
    assert (run_folder(out_dir) / "model" / "model.safetensors").exists() and (run_folder(out_dir) / "accuracy.png").exists()


@pytest.mark.slow  # CI: a real flwr run of the same apps completes in tests/test_e2e_tls.py (one short round)
def test_default_main_job_reaches_90_percent(flwr_home: Path, tmp_path: Path) -> None:
    """The README's main job (4 IID clients, MNIST CNN, pyproject defaults) through ``flwr run``."""
    env = _env(flwr_home)
    out_dir = tmp_path / "outputs"
    output = flwr_run([".", "local", "--stream", "--run-config", f"output-dir='{out_dir}'", "--federation-config",
                       "num-supernodes=4 client-resources-num-cpus=1"], env)
    assert _status("local", _run_id(output), env) == "finished:completed", output[-4000:]
    history = json.loads((run_folder(out_dir) / "history.json").read_text())
    assert history["rounds"][-1]["evaluate"]["eval-accuracy"] >= 0.90


@pytest.mark.slow
def test_main_job_over_two_trunk_replicas_reaches_90_percent(flwr_home: Path, tmp_path: Path) -> None:
    """The main job with ``trunk-replicas=2`` (two gloo trunk processes spawned by the ServerApp) through
    ``flwr run``; ``tests/test_replicas_run.py`` is its fast in-process check."""
    env = _env(flwr_home)
    out_dir = tmp_path / "outputs"
    output = flwr_run([".", "local", "--stream", "--run-config", f"trunk-replicas=2 output-dir='{out_dir}'",
                       "--federation-config", "num-supernodes=4 client-resources-num-cpus=1"], env)
    assert _status("local", _run_id(output), env) == "finished:completed", output[-4000:]
    history = json.loads((run_folder(out_dir) / "history.json").read_text())
    assert history["rounds"][-1]["evaluate"]["eval-accuracy"] >= 0.90
    assert history["rounds"][-1]["trunk"]["trunk-steps"] > 0


def _wait_port(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


@pytest.mark.slow
def test_deployment_superlink_and_two_supernodes(flwr_home: Path, tmp_path: Path) -> None:
    env = _env(flwr_home)
    # Flower 1.42 serves the Runtime, Control and Fleet APIs on one HTTP port.
    link = _free_port()
    trunk_port = _free_port()
    out_dir = tmp_path / "outputs"
    logs = tmp_path / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(subprocess.Popen(
            [str(BIN / "flower-superlink"), "--insecure", "--isolation", "subprocess",
             "--disable-runtime-dependency-installation", "--host", "127.0.0.1", "--port", str(link),
             "--database", str(tmp_path / "state.db")],
            cwd=tmp_path, env=env, stdout=open(logs / "superlink.log", "wb"), stderr=subprocess.STDOUT))
        _wait_port(link)
        for pid in range(2):
            procs.append(subprocess.Popen(
                [str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{link}",
                 "--host", "127.0.0.1", "--port", str(_free_port()), "--isolation", "subprocess",
                 "--node-config", f"partition-id={pid} num-partitions=2"],
                cwd=tmp_path, env=env, stdout=open(logs / f"supernode{pid}.log", "wb"), stderr=subprocess.STDOUT))
        (flwr_home / "config.toml").write_text(
            f'[superlink]\ndefault = "deploy"\n\n[superlink.deploy]\naddress = "127.0.0.1:{link}"\n'
            "insecure = true\n")
        overrides = (f"num-server-rounds=2 local-steps=10 trunk-port={trunk_port} "
                     f"trunk-advertise='127.0.0.1:{trunk_port}' output-dir='{out_dir}'")
        result = subprocess.run([str(BIN / "flwr"), "run", ".", "deploy", "--stream", "--run-config", overrides],
                                cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        output = result.stdout + result.stderr
        run_id = _run_id(output)
        assert _status("deploy", run_id, env) == "finished:completed", output[-3000:]
        history = json.loads((run_folder(out_dir) / "history.json").read_text())
        assert [r["round"] for r in history["rounds"]] == [1, 2]
        assert history["rounds"][-1]["train"]["train-steps"] == 20  # two supernodes, 10 steps each
        assert history["rounds"][-1]["evaluate"]["num-examples"] == 1000
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        if out_dir.exists():
            shutil.rmtree(out_dir, ignore_errors=True)
