"""Kill the ServerApp's process mid-run; a restart resumes from the last completed round with the trunk,
its optimizer and the client parts exactly as checkpointed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from flower_harness import ROOT, default_run_config, run_apps
from safetensors.torch import load_file

from splitfed.config import RunConfig
from splitfed.runner import ServerRunner

RUN = r"""
import sys
sys.path.insert(0, sys.argv[2])
from pathlib import Path
from flower_harness import run_apps
run_apps(Path(sys.argv[1]), num_nodes=2, concurrency=2, num_server_rounds=6, local_steps=25)
"""


def test_server_killed_mid_run_resumes_from_the_last_completed_round(tmp_path: Path) -> None:
    state_file = tmp_path / "outputs" / "checkpoint" / "state.json"
    proc = subprocess.Popen([sys.executable, "-c", RUN, str(tmp_path), str(ROOT / "tests")], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if state_file.exists() and json.loads(state_file.read_text())["round"] >= 2:
                break
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    meta = json.loads(state_file.read_text())
    done = meta["round"]
    assert 2 <= done < 6, "killed after the last round; make rounds longer"
    trunk = load_file(str(tmp_path / "outputs" / "checkpoint" / "trunk.safetensors"))
    optimizer = torch.load(tmp_path / "outputs" / "checkpoint" / "optimizer.pt", weights_only=True)
    # A restarted server starts exactly from the checkpoint...
    cfg = RunConfig.from_mapping(default_run_config(output_dir=str(tmp_path / "outputs"), resume=True,
                                                    num_server_rounds=6, local_steps=25))
    runner = ServerRunner(cfg)
    assert runner.round_offset == done and runner.runtime.version == meta["trunk-version"]
    assert all(torch.equal(v, runner.runtime.trunk.state_dict()[k]) for k, v in trunk.items())
    restored = runner.runtime.optimizer.state_dict()
    assert restored["state"].keys() == optimizer["state"].keys()
    assert all(torch.equal(restored["state"][i]["momentum_buffer"], optimizer["state"][i]["momentum_buffer"])
               for i in optimizer["state"])
    # ...and the run completes the remaining rounds.
    grid, out = run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=6, local_steps=25, resume=True)
    history = json.loads((out / "history.json").read_text())
    assert [r["round"] for r in history["rounds"]] == list(range(1, 7))
    assert sorted({int(m.content["splitfed"]["server-round"]) for m in grid.sent}) == list(range(done + 1, 7))
