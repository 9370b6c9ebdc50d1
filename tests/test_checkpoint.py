"""Checkpoints survive crashes: a process killed at any step of ``checkpoint()`` leaves a usable checkpoint,
``resume`` falls back to the previous one when the newest is damaged, temporary folders of dead processes are
removed, and ``resume = true`` with no usable checkpoint fails naming the folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from flower_harness import ROOT, default_run_config, run_apps

from splitfed.run.checkpoint import CURRENT, FOLDER, flatten, read_checkpoint, unflatten
from splitfed.config import RunConfig
from splitfed.errors import CheckpointError
from splitfed.run.server import ServerRunner

STEPS = ("files-written", "folder-synced", "folder-renamed", "link-made", "switched")

# Round 1 is checkpointed; the trunk changes; the process dies inside round 2's checkpoint at STEP.
CRASH = r"""
import os, sys
sys.path.insert(0, sys.argv[3])
import torch
import splitfed.run.checkpoint as ckpt
from flower_harness import default_run_config
from splitfed.config import RunConfig
from splitfed.run.server import ServerRunner

runner = ServerRunner(RunConfig.from_mapping(default_run_config(output_dir=sys.argv[1])))
runner.checkpoint(1)
with torch.no_grad():
    for p in runner.runtime.trunk.parameters():
        p.add_(1.0)
ckpt.step_hook = lambda step: os._exit(0) if step == sys.argv[2] else None
runner.checkpoint(2)
os._exit(3)
"""


def _runner(out: Path, resume: bool = True) -> ServerRunner:
    return ServerRunner(RunConfig.from_mapping(default_run_config(output_dir=str(out), resume=resume)))


def _trunk_plus_one(out: Path) -> dict[str, torch.Tensor]:
    fresh = _runner(out, resume=False)
    return {k: v + 1.0 for k, v in fresh.runtime.trunk.state_dict().items() if v.is_floating_point()}


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int, str]]:
    """One process per step of STEPS, each dying there in a run folder of its own; started together (each spends
    its seconds importing), awaited together. By step: the output folder, the exit code and the stderr."""
    base = tmp_path_factory.mktemp("crashed")
    started = {}
    try:
        for step in STEPS:
            err = open(base / f"{step}.stderr", "w")  # a file, not a pipe: no child waits on a full pipe
            started[step] = subprocess.Popen([sys.executable, "-c", CRASH, str(base / step / "outputs"), step,
                                              str(ROOT / "tests")], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
            err.close()
        for proc in started.values():
            proc.wait(300)
    finally:
        for proc in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    return {step: (base / step / "outputs", proc.returncode, (base / f"{step}.stderr").read_text())
            for step, proc in started.items()}


@pytest.mark.parametrize("step", STEPS)
def test_a_process_killed_inside_checkpoint_leaves_a_usable_checkpoint(crashed: dict[str, tuple[Path, int, str]],
                                                                       step: str) -> None:
    out, returncode, stderr = crashed[step]
    assert returncode == 0, stderr[-3000:]  # it died at the hook, not after
    runner = _runner(out)
    # Before the switch the round-1 checkpoint is current and whole; from the switch on, round 2's.
    expected_round = 2 if step == "switched" else 1
    assert runner.round_offset == expected_round
    trunk = runner.runtime.trunk.state_dict()
    changed = _trunk_plus_one(out)
    assert all(torch.equal(trunk[k], v) == (expected_round == 2) for k, v in changed.items())
    # The dead process's temporary folder or link is removed by the next checkpoint, which becomes current.
    runner.checkpoint(expected_round + 1)
    assert not list((out / FOLDER).glob(".tmp-*")) and not list(out.glob(f".{CURRENT}-*"))
    assert json.loads((out / CURRENT / "state.json").read_text())["round"] == expected_round + 1
    assert len([p for p in (out / FOLDER).iterdir()]) == 2  # the newest and one fallback


def test_resume_falls_back_to_the_previous_checkpoint_when_the_newest_is_damaged(tmp_path: Path) -> None:
    out = tmp_path / "outputs"
    runner = _runner(out, resume=False)
    runner.checkpoint(1)
    first = {k: v.clone() for k, v in runner.runtime.trunk.state_dict().items()}
    with torch.no_grad():
        for p in runner.runtime.trunk.parameters():
            p.mul_(2.0)
    runner.checkpoint(2)
    damaged = (out / CURRENT / "trunk.safetensors")
    damaged.write_bytes(damaged.read_bytes()[:100])  # a torn write
    resumed = _runner(out)
    assert resumed.round_offset == 1
    assert all(torch.equal(first[k], v) for k, v in resumed.runtime.trunk.state_dict().items())
    # The resumed run's round 2 replaces the damaged one; round 1 stays as the fallback.
    resumed.checkpoint(2)
    assert sorted(json.loads((p / "state.json").read_text())["round"] for p in (out / FOLDER).iterdir()) == [1, 2]
    assert read_checkpoint(out).meta["round"] == 2


def test_resume_without_a_usable_checkpoint_fails_naming_the_folder(tmp_path: Path) -> None:
    out = tmp_path / "empty-outputs"
    with pytest.raises(CheckpointError, match=f"{out} holds no usable checkpoint.*resume = false"):
        _runner(out)
    # Through the apps: the run fails instead of silently starting from round 0.
    with pytest.raises(CheckpointError, match="holds no run to continue.*resume = false"):
        run_apps(tmp_path / "fresh", num_nodes=2, concurrency=2, num_server_rounds=1, local_steps=1, resume=True)
    assert not list((tmp_path / "fresh" / "outputs").glob("*"))  # no run folder was made


def test_a_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "outputs"
    _runner(out, resume=False).checkpoint(1)
    cfg = RunConfig.from_mapping(default_run_config(output_dir=str(out), resume=True, cuts="2,6"))
    with pytest.raises(Exception, match="cuts 3,6 there, 2,6 here"):
        ServerRunner(cfg)


def test_stale_temporaries_of_live_processes_are_kept(tmp_path: Path) -> None:
    from splitfed.run.checkpoint import remove_stale_temporaries

    (tmp_path / FOLDER).mkdir()
    live = tmp_path / FOLDER / f".tmp-{os.getppid()}-round-000001-aaaa"  # the parent process is alive
    dead = tmp_path / FOLDER / ".tmp-999999999-round-000001-bbbb"
    legacy = tmp_path / ".checkpoint-999999999"
    for folder in (live, dead, legacy):
        folder.mkdir()
    removed = remove_stale_temporaries(tmp_path)
    assert set(removed) == {dead, legacy} and live.exists()


def test_optimizer_state_round_trips_through_json_and_safetensors() -> None:
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))]
    opt = torch.optim.AdamW(params, lr=0.01)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    tensors: dict[str, torch.Tensor] = {}
    doc = json.loads(json.dumps(flatten(opt.state_dict(), tensors)))
    restored = unflatten(doc, tensors)
    fresh = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=0.5)
    fresh.load_state_dict(restored)
    assert fresh.param_groups[0]["lr"] == 0.01
    for i in range(2):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(fresh.state_dict()["state"][i][key], opt.state_dict()["state"][i][key])


def test_read_checkpoint_prefers_the_current_one(tmp_path: Path) -> None:
    runner = _runner(tmp_path, resume=False)
    runner.checkpoint(1)
    runner.checkpoint(2)
    saved = read_checkpoint(tmp_path)
    assert saved.meta["round"] == 2 and saved.folder == (tmp_path / CURRENT).resolve()
