"""A ServerApp of one's own (``strategies.run.splitfed_run``), run directories, and any strategy's state."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flower_harness import SUPERLINK_NODE, ThreadGrid, default_run_config, run_apps
from flwr.app import Context, RecordDict
from flwr.serverapp.strategy import DifferentialPrivacyServerSideAdaptiveClipping, FedAdam, FedAvg

from flwr.supercore.task_identity import TaskIdentity

from splitfed.errors import ConfigError
from splitfed.run.rundirs import latest_run, list_runs
from strategies.state import load_strategy_state, strategy_state


def _context(grid: ThreadGrid, config: dict) -> Context:
    """The ServerApp's context, with what Flower's runtime sets in a ServerApp process."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = grid.run_id, SUPERLINK_NODE, 1
    return Context(run_id=grid.run_id, node_id=SUPERLINK_NODE, node_config={}, state=RecordDict(), run_config=config)


def _own_app(tmp_path: Path, **overrides):
    from apps.client_app import app as client_app
    from examples.own_server_app import main

    config = default_run_config(output_dir=str(tmp_path / "outputs"), **overrides)
    grid = ThreadGrid(client_app, 2, config, concurrency=2)
    context = _context(grid, config)
    try:
        return main(grid, context)
    finally:
        grid.close()


def test_an_own_server_app_gets_flowers_result_with_central_evaluation(tmp_path: Path) -> None:
    result = _own_app(tmp_path, num_server_rounds=2, local_steps=3)
    assert sorted(result.evaluate_metrics_serverapp) == [0, 1, 2]  # Flower evaluates before round 1 too
    assert all(0.0 <= m["eval-accuracy"] <= 1.0 for m in result.evaluate_metrics_serverapp.values())
    assert sorted(result.train_metrics_clientapp) == [1, 2] and "train-loss" in result.train_metrics_clientapp[2]
    assert len(result.arrays) > 0
    run = latest_run(tmp_path / "outputs")
    history = json.loads((run / "history.json").read_text())
    assert history["status"] == "completed"
    assert history["strategy-classes"]["strategy"] == "flwr.serverapp.strategy.fedadam.FedAdam"
    central = {r["round"]: r["central"]["eval-accuracy"] for r in history["rounds"]}
    assert central == {r: result.evaluate_metrics_serverapp[r]["eval-accuracy"] for r in (1, 2)}
    assert (run / "model" / "model.safetensors").exists()


def test_two_runs_keep_their_own_folders_and_a_resume_continues_the_one_it_names(tmp_path: Path) -> None:
    _, first = run_apps(tmp_path, num_nodes=2, num_server_rounds=1, local_steps=1)
    _, second = run_apps(tmp_path, num_nodes=2, num_server_rounds=1, local_steps=1)
    assert first != second and list_runs(tmp_path / "outputs") == sorted([first, second])
    assert latest_run(tmp_path / "outputs") == second
    assert (first / "history.json").exists() and (first / "model").exists()
    # resume = <the first run's folder> goes on in that folder, not in the latest one.
    _, resumed = run_apps(tmp_path, num_nodes=2, num_server_rounds=2, local_steps=1, resume=str(first))
    assert resumed == first
    assert [r["round"] for r in json.loads((first / "history.json").read_text())["rounds"]] == [1, 2]
    assert [r["round"] for r in json.loads((second / "history.json").read_text())["rounds"]] == [1]


def test_a_trunk_strategy_outside_per_client_mode_is_an_error(tmp_path: Path) -> None:
    from apps.server_app import run
    from apps.client_app import app as client_app

    config = default_run_config(output_dir=str(tmp_path / "outputs"), num_server_rounds=1, local_steps=1)
    grid = ThreadGrid(client_app, 2, config)
    context = _context(grid, config)
    with pytest.raises(ConfigError, match="trunk-mode = 'per-client'"):
        run(grid, context, trunk_strategy=lambda cfg: FedAvg())
    grid.close()


class Boom(FedAvg):
    def aggregate_train(self, server_round, replies):
        if server_round == 2:
            raise ValueError("boom in round 2")
        return super().aggregate_train(server_round, replies)


def test_a_strategy_hook_that_raises_leaves_a_failed_history_with_the_rounds_done(tmp_path: Path) -> None:
    from apps.client_app import app as client_app
    from apps.server_app import run

    config = default_run_config(output_dir=str(tmp_path / "outputs"), num_server_rounds=3, local_steps=1)
    grid = ThreadGrid(client_app, 2, config)
    context = _context(grid, config)
    with pytest.raises(ValueError, match="boom"):
        run(grid, context, strategy=lambda cfg: Boom(min_train_nodes=2, min_available_nodes=2))
    grid.close()
    history = json.loads((latest_run(tmp_path / "outputs") / "history.json").read_text())
    assert history["status"] == "failed" and "ValueError: boom in round 2" in history["error"]
    assert [r["round"] for r in history["rounds"]] == [1]
    assert history["strategy-classes"]["strategy"].endswith("Boom")


class Counting(FedAvg):
    """A custom strategy with state of its own: a counter, a list of floats, an array."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seen = 0
        self.losses: list[float] = []
        self.ema = np.zeros(3, dtype=np.float32)


def test_any_strategys_state_round_trips_without_its_settings() -> None:
    a = Counting()
    a.seen, a.losses, a.ema = 7, [0.5, 0.25], np.arange(3, dtype=np.float32)
    b = Counting()
    load_strategy_state(b, strategy_state(a))
    assert (b.seen, b.losses) == (7, [0.5, 0.25]) and np.array_equal(b.ema, a.ema) and b.ema.dtype == np.float32
    dp = DifferentialPrivacyServerSideAdaptiveClipping(FedAdam(), noise_multiplier=0.1, num_sampled_clients=2)
    dp.clipping_norm = 0.123456789
    dp.strategy.m_t = {"w": np.ones(2)}
    saved = strategy_state(dp)
    assert "0/num_sampled_clients/py" not in saved  # a setting, not state
    fresh = DifferentialPrivacyServerSideAdaptiveClipping(FedAdam(), noise_multiplier=0.1, num_sampled_clients=2)
    load_strategy_state(fresh, saved)
    assert fresh.clipping_norm == 0.123456789 and np.array_equal(fresh.strategy.m_t["w"], np.ones(2))


def test_fedadams_moments_on_v1_trunk_copies_are_checkpointed_and_restored(tmp_path: Path) -> None:
    from splitfed.config import RunConfig
    from splitfed.run.server import ServerRunner
    from strategies import SplitFed, build_strategy
    from strategies.trunk_copies import build_trunk_strategy

    settings = dict(num_server_rounds=1, local_steps=2, trunk_mode="per-client", trunk_strategy="fedadam")
    _, run = run_apps(tmp_path, num_nodes=2, **settings)
    history = json.loads((run / "history.json").read_text())
    assert history["strategy-classes"]["trunk-strategy"].endswith("FedAdam")
    assert history["rounds"][0]["trunk"]["trunk-copies"] == 2
    cfg = RunConfig.from_mapping(default_run_config(output_dir=str(run), resume=True, **settings))
    runner = ServerRunner(cfg)
    try:
        saved = {k: v for k, v in runner.strategy_state.items() if k.startswith("trunk-0/m_t/")}
        assert saved
        trunk = build_trunk_strategy(cfg)
        SplitFed(build_strategy(cfg), runner, trunk_strategy=trunk)
        assert all(np.array_equal(trunk.m_t[k.split("/")[2][2:]], v.numpy()) for k, v in saved.items())
    finally:
        runner.server.stop(grace=0)


def test_report_of_an_output_dir_lists_its_runs_and_reports_the_latest(tmp_path: Path, capsys) -> None:
    from splitfed.cli.main import main
    from splitfed.run.rundirs import new_run_dir

    out = tmp_path / "outputs"
    for run_id, accuracy in ((1, 0.5), (2, 0.75)):
        folder = new_run_dir(out, run_id)
        rounds = [{"round": 1, "train": {"train-loss": 1.0}, "evaluate": {"eval-accuracy": accuracy}, "seconds": 1}]
        (folder / "history.json").write_text(json.dumps({"status": "completed", "rounds": rounds}))
    assert main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "run1 " in printed and "run2 " in printed and "eval-accuracy 0.5000" in printed
    assert f"report of {latest_run(out)}" in printed and latest_run(out).name.endswith("run2")
    assert "0.7500" in printed.split("report of")[1]  # the table is the latest run's
