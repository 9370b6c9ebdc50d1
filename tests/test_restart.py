"""Kill the ServerApp's process mid-run; a restart resumes from the last completed round with the trunk, its
optimizer, the client parts, the inner strategy's state (FedAdam's moments) and the clients' privacy
accountants exactly as they were at the end of that round in the killed process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from flower_harness import ROOT, default_run_config, run_apps, state_digest

from splitfed.config import RunConfig
from splitfed.run.server import ServerRunner

ROUNDS, STEPS = 4, 8  # the kill lands at the end of round 2 or 3, with rounds to spare
SETTINGS = dict(num_server_rounds=ROUNDS, local_steps=STEPS, strategy="fedadam", dp_noise_multiplier=1.0)

# The child records a digest of the server's state at the end of every round, just before its checkpoint.
RUN = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
from pathlib import Path
from flower_harness import run_apps, state_digest
from splitfed.run.server import ServerRunner

digests = Path(sys.argv[1]) / "digests.jsonl"
checkpoint = ServerRunner.checkpoint


def recording(self, server_round):
    with open(digests, "a") as f:
        f.write(json.dumps({"round": server_round, **state_digest(self)}) + "\n")
    return checkpoint(self, server_round)


ServerRunner.checkpoint = recording
run_apps(Path(sys.argv[1]), num_nodes=2, concurrency=2, **json.loads(sys.argv[3]))
"""


def test_server_killed_mid_run_resumes_from_the_last_completed_round(tmp_path: Path) -> None:
    state_file = tmp_path / "outputs" / "latest" / "checkpoint" / "state.json"  # the run's own folder
    proc = subprocess.Popen([sys.executable, "-c", RUN, str(tmp_path), str(ROOT / "tests"), json.dumps(SETTINGS)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if json.loads(state_file.read_text())["round"] >= 2:
                    break
            except (FileNotFoundError, ValueError):
                pass  # not written yet
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    done = json.loads(state_file.read_text())["round"]
    assert 2 <= done < ROUNDS, "killed after the last round; make rounds longer"
    recorded = {d.pop("round"): d for d in map(json.loads, (tmp_path / "digests.jsonl").read_text().splitlines())}
    # A restarted server starts exactly from the state the killed one had at the end of that round...
    cfg = RunConfig.from_mapping(default_run_config(output_dir=str(tmp_path / "outputs" / "latest"), resume=True,
                                                    **SETTINGS))
    runner = ServerRunner(cfg)
    assert runner.round_offset == done
    assert state_digest(runner) == recorded[done]
    assert runner.strategy_state and set(runner.privacy_states) == {"0", "1"}
    # ...the accountants have counted every step so far...
    assert all(sum(s["dp-steps"]) == done * STEPS for s in runner.privacy_states.values())
    # ...and the run completes the remaining rounds, the clients' epsilon going on from where it was.
    grid, out = run_apps(tmp_path, num_nodes=2, concurrency=2, resume=True, **SETTINGS)
    history = json.loads((out / "history.json").read_text())
    assert [r["round"] for r in history["rounds"]] == list(range(1, ROUNDS + 1))
    rounds_sent = sorted({int(m.content["config"]["splitfed.server-round"]) for m in grid.sent})
    assert rounds_sent == list(range(done + 1, ROUNDS + 1))
    epsilons = [r["train"]["train-epsilon"] for r in history["rounds"]]
    assert epsilons == sorted(epsilons) and len(set(epsilons)) == ROUNDS
    states = [dict(c.state["splitfed-privacy"]) for c in grid.contexts.values()]
    assert [sum(s["dp-steps"]) for s in states] == [ROUNDS * STEPS, ROUNDS * STEPS]


@pytest.mark.parametrize("strategy", ["fedadam", "fedavgm"])  # FedYogi, FedAdagrad: the same m_t, v_t
def test_resumed_strategy_state_is_the_checkpointed_one(tmp_path: Path, strategy: str) -> None:
    from strategies import SplitFed, build_strategy
    from strategies.state import strategy_state

    _, out = run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=1, local_steps=2, strategy=strategy)
    cfg = RunConfig.from_mapping(default_run_config(output_dir=str(out), resume=True, num_server_rounds=2,
                                                    local_steps=2, strategy=strategy))  # the run's own settings
    runner = ServerRunner(cfg)
    saved = runner.strategy_state
    expected = {"v_t", "m_t"} if strategy != "fedavgm" else {"momentum_vector"}
    assert expected <= {name.split("/")[1] for name in saved}  # and derived values (FedAvgM's server_opt)
    inner = build_strategy(cfg)
    SplitFed(inner, runner)  # loads the state into the inner strategy
    restored = strategy_state(inner)
    assert restored.keys() == saved.keys()
    assert all(restored[k].equal(saved[k]) for k in saved)  # flags (bool tensors) and counts too
    moments = [k for k in saved if k.split("/")[1] in expected]
    assert moments and all(saved[k].abs().sum() > 0 for k in moments)  # a round moved them
