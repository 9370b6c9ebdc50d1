"""One short real ``flwr run . local`` per trunk mode and variant: async, quorum, two trunk replicas, a ClientApp
process killed mid-step (dropout), per-client (SplitFed V1), heterogeneous client cuts and a ServerApp process killed
mid-run then resumed (restart). All are slow tests (``python -m pytest -q -m slow``); the fast tier covers each
without a ``flwr run`` of its own: ``tests/test_e2e_tls.py``'s run is async, ``tests/test_flower_apps.py`` runs the
apps in every trunk mode, ``tests/test_reliability.py`` kills clients mid-step, ``tests/test_hetero_cuts.py`` trains
heterogeneous cuts and ``tests/test_restart.py`` kills and resumes a run. The sync main job is in
``test_e2e_flwr.py`` and sequential (V2) in ``test_e2e_variants.py``. The module's runs share one local SuperLink;
every process a test starts is ended, by FLWR_HOME or Ray's temp folder."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from flower_harness import run_folder
from test_e2e_flwr import (
    BIN,
    ROOT,
    _env,
    _kill_tree_matching,
    _run_id,
    _status,
    flwr_run,
    start_local_superlink,
)

FOUR = "num-supernodes=4 client-resources-num-cpus=1"  # quorum: clients must overlap in time
TWO = "num-supernodes=2 client-resources-num-cpus=1"


class Federation:
    """A FLWR_HOME with its local SuperLink, shared by the module's runs."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.env = _env(home)
        self.ray_tmp = (home / "ray-tmpdir").read_text()

    def run(self, out_dir: Path, overrides: str, federation: str) -> dict[str, Any]:
        """A run that must complete; returns its history."""
        output = flwr_run([".", "local", "--stream", "--run-config", f"{overrides} output-dir='{out_dir}'",
                           "--federation-config", federation], self.env)
        assert _status("local", _run_id(output), self.env) == "finished:completed", output[-4000:]
        return json.loads((run_folder(out_dir) / "history.json").read_text())

    def run_until(self, out_dir: Path, overrides: str, federation: str, act: Callable[[str], bool],
                  timeout: float = 900) -> tuple[str, str]:
        """A run whose streamed output ``act`` watches (it returns True once it did its part); returns the run's
        output and status."""
        start_local_superlink(self.env)
        log = out_dir.parent / f"{out_dir.name}.log"
        with open(log, "w") as sink:
            proc = subprocess.Popen([str(BIN / "flwr"), "run", ".", "local", "--stream", "--run-config",
                                     f"{overrides} output-dir='{out_dir}'", "--federation-config", federation],
                                    cwd=ROOT, env=self.env, stdout=sink, stderr=subprocess.STDOUT)
            try:
                deadline, acted = time.monotonic() + timeout, False
                while proc.poll() is None and time.monotonic() < deadline:
                    acted = acted or act(log.read_text())
                    time.sleep(0.1)
                if proc.poll() is None:  # the stream may outlive a killed ServerApp
                    proc.terminate()
                proc.wait(60)
            finally:
                if proc.poll() is None:
                    proc.kill()
        output = log.read_text()
        assert acted, output[-4000:]
        return output, _status("local", _run_id(output), self.env)

    def processes(self, marker: str) -> list[psutil.Process]:
        """This federation's processes whose command line names ``marker``."""
        found = []
        for p in psutil.process_iter(["cmdline", "environ"]):
            env = p.info.get("environ") or {}
            ours = env.get("FLWR_HOME") == str(self.home) or env.get("RAY_TMPDIR") == self.ray_tmp
            if ours and marker in " ".join(p.info["cmdline"] or []):
                found.append(p)
        return found

    def close(self) -> None:
        _kill_tree_matching(str(self.home))
        _kill_tree_matching(self.ray_tmp)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Federation]:
    fed = Federation(tmp_path_factory.mktemp("flwr-home"))
    try:
        yield fed
    finally:
        fed.close()


def _last(history: dict[str, Any]) -> dict[str, Any]:
    return history["rounds"][-1]


@pytest.mark.slow  # CI: tests/test_e2e_tls.py's run is async and asserts the same counts
def test_async_run_steps_the_trunk_per_gradient(federation: Federation, tmp_path: Path) -> None:
    history = federation.run(tmp_path / "out", "trunk-mode='async' num-server-rounds=1 local-steps=3", TWO)
    last = _last(history)
    assert last["train"]["train-steps"] == 2 * 3 and last["failures"]["train"] == 0
    trunk = last["trunk"]
    assert trunk["trunk-steps"] == trunk["trunk-applied"] + trunk["trunk-downweighted"] > 0  # one step per gradient
    assert trunk["trunk-applied"] + trunk["trunk-rejected-stale"] + trunk["trunk-downweighted"] == 2 * 3


@pytest.mark.slow
def test_quorum_run_completes_with_every_gradient_counted(federation: Federation, tmp_path: Path) -> None:
    """A real quorum run. How many gradients each step holds depends on how the clients' training overlaps (a
    client that is done leaves the step group, and a step waits for min(k, members)), which a busy machine
    decides: that a quorum step holds k gradients is asserted in-process (tests/test_aggregation.py)."""
    history = federation.run(tmp_path / "out", "trunk-mode='quorum' quorum=2 num-server-rounds=1 local-steps=10", FOUR)
    last = _last(history)
    assert last["train"]["train-steps"] == 4 * 10 and last["failures"]["train"] == 0
    trunk = last["trunk"]
    counted = trunk["trunk-applied"] + trunk["trunk-downweighted"] + trunk["trunk-rejected-stale"]
    assert counted == 4 * 10 and 0 < trunk["trunk-steps"] <= trunk["trunk-applied"] + trunk["trunk-downweighted"]


@pytest.mark.slow
def test_per_client_run_merges_a_copy_per_client(federation: Federation, tmp_path: Path) -> None:
    history = federation.run(tmp_path / "out", "trunk-mode='per-client' num-server-rounds=1 local-steps=3", TWO)
    last = _last(history)
    assert last["trunk"]["trunk-copies"] == 2 and last["trunk"]["trunk-copy-examples"] == 2 * 3 * 32
    assert last["trunk"]["trunk-version"] == 1  # the round's merge
    assert last["trunk"]["trunk-applied"] == 2 * 3  # each gradient stepped its client's copy


@pytest.mark.slow
def test_client_cuts_run_trains_both_cuts(federation: Federation, tmp_path: Path) -> None:
    out = tmp_path / "out"
    history = federation.run(out, "client-cuts='1,6 4,9' num-server-rounds=1 local-steps=3", TWO)
    last = _last(history)
    assert last["train"]["train-steps"] == 2 * 3 and last["failures"]["train"] == 0
    assert last["trunk"]["trunk-steps"] > 0
    assert (run_folder(out) / "model" / "model.safetensors").exists()


@pytest.mark.slow
def test_two_trunk_replicas_run_global_sync_steps(federation: Federation, tmp_path: Path) -> None:
    history = federation.run(tmp_path / "out", "trunk-replicas=2 num-server-rounds=1 local-steps=3", TWO)
    last = _last(history)
    assert last["train"]["train-steps"] == 2 * 3 and last["failures"]["train"] == 0
    trunk = last["trunk"]
    assert trunk["trunk-replicas-live"] == 2
    assert trunk["trunk-version"] == trunk["trunk-steps"] > 0  # rank 0 took every global step


@pytest.mark.slow
def test_a_clientapp_process_killed_mid_step_is_dropped_and_the_run_completes(federation: Federation,
                                                                             tmp_path: Path) -> None:
    # Execute: once two clients train together, the Ray actor of one that is connected to the trunk is killed.
    killed: list[int] = []

    def kill_a_training_client(output: str) -> bool:
        port = re.search(r"trunk server listening on [\d.]+:(\d+)", output)
        if port is None:
            return False
        connected = {c.pid for c in psutil.net_connections("tcp")
                     if c.raddr and c.raddr.port == int(port.group(1)) and c.status == psutil.CONN_ESTABLISHED}
        victims = [p for p in federation.processes("ClientAppActor") if p.pid in connected]
        if len(victims) >= 2:  # two clients connected to the trunk: they train together
            victims[0].kill()
            killed.append(victims[0].pid)
            return True
        return False

    out = tmp_path / "out"
    output, status = federation.run_until(
        out, "num-server-rounds=1 local-steps=200 trunk-timeout=10", "num-supernodes=3 client-resources-num-cpus=1 "
        "init-args-num-cpus=3", kill_a_training_client)
    # Assert: the run completed without that client; the trunk dropped it once, the others trained every step.
    assert status == "finished:completed", output[-4000:]
    (round1,) = json.loads((run_folder(out) / "history.json").read_text())["rounds"]
    assert round1["failures"]["train"] == 1 and "actor died" in round1["failures"]["first-error"].lower()
    assert round1["trunk"]["trunk-dropped-members"] == 1
    assert round1["train"]["train-steps"] == 2 * 200


@pytest.mark.slow
def test_a_serverapp_killed_mid_run_resumes_from_its_checkpoint(federation: Federation, tmp_path: Path) -> None:
    # Execute: the ServerApp's process (flwr-simulation) is killed once round 1's checkpoint is written.
    out = tmp_path / "out"
    state = out / "latest" / "checkpoint" / "state.json"
    settings = "num-server-rounds=2 local-steps=3"
    done: list[int] = []

    def kill_after_round_1(_: str) -> bool:
        try:
            saved = json.loads(state.read_text())["round"]
        except (FileNotFoundError, ValueError):
            return False  # not written yet
        for p in federation.processes("flwr-simulation"):
            p.kill()
        done.append(saved)
        return True

    output, status = federation.run_until(out, settings, TWO, kill_after_round_1)
    assert status != "finished:completed" and done and done[0] == 1, (status, done, output[-3000:])
    _kill_tree_matching(federation.ray_tmp)  # the killed run's Ray
    # A new run with resume = true goes on from that round.
    resumed = flwr_run([".", "local", "--stream", "--run-config", f"{settings} resume=true output-dir='{out}'",
                        "--federation-config", TWO], federation.env)
    assert _status("local", _run_id(resumed), federation.env) == "finished:completed", resumed[-4000:]
    assert f"resuming from the checkpoint of round {done[0]}" in resumed
    history = json.loads((run_folder(out) / "history.json").read_text())
    assert [r["round"] for r in history["rounds"]] == [1, 2] and history["status"] == "completed"
