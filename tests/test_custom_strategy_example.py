"""examples/lr_decay.py changes what the clients do: their SGD step shrinks by the decay each round (measured on the
client parts they send back, not read from the config); and bench.strategies' table code."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from flower_harness import ROOT, SUPERLINK_NODE, ThreadGrid, default_run_config


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("example_lr_decay", ROOT / "examples" / "lr_decay.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _norm(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum(((after[k].double() - before[k].double()) ** 2).sum() for k in before)))


def test_lr_decay_strategy_shrinks_the_clients_step_round_by_round(tmp_path, monkeypatch) -> None:
    """The example's ServerApp with decay 0.1, 2 rounds of one plain SGD step per client: round 2's update (the
    client parts a client sends back minus the round's global parts) is about 0.1x round 1's."""
    from flwr.app import Context, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from apps.client_app import app as client_app

    example = _example()
    starts: list[dict[str, torch.Tensor]] = []
    replies: list[list[dict[str, torch.Tensor]]] = []

    class Spied(example.LrDecayFedAvg):  # type: ignore[name-defined,misc]
        def configure_train(self, server_round: int, arrays: Any, config: Any, grid: Any) -> Any:
            starts.append(arrays.to_torch_state_dict())
            return super().configure_train(server_round, arrays, config, grid)

        def aggregate_train(self, server_round: int, messages: Any) -> Any:
            messages = list(messages)
            replies.append([m.content["arrays"].to_torch_state_dict() for m in messages if not m.has_error()])
            return super().aggregate_train(server_round, messages)

    real_build = example.build
    monkeypatch.setattr(example, "LrDecayFedAvg", Spied)
    monkeypatch.setattr(example, "build", lambda cfg: real_build(cfg, 0.1))
    config = default_run_config(output_dir=str(tmp_path / "outputs"), num_server_rounds=2, local_steps=1, lr=0.05,
                                momentum=0.0, fraction_evaluate=0.0)
    grid = ThreadGrid(client_app, 2, config, concurrency=2)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = grid.run_id, SUPERLINK_NODE, 1
    try:
        example.app(grid, Context(run_id=grid.run_id, node_id=SUPERLINK_NODE, node_config={}, state=RecordDict(),
                                  run_config=config))
    finally:
        grid.close()
    assert len(replies) == 2 and all(len(r) == 2 for r in replies)
    first, second = (sorted(_norm(r, start) for r in rs) for start, rs in zip(starts, replies))
    ratios = [b / a for a, b in zip(first, second)]
    assert all(0.03 < r < 0.3 for r in ratios), (first, second)  # lr 10x lower: a step about 10x shorter


def test_lr_decay_sends_the_decayed_lr() -> None:
    lrs = _example().main()
    assert lrs[0] == pytest.approx(0.05) and lrs[2] == pytest.approx(0.05 * 0.25)


def test_bench_strategies_covers_every_strategy_and_dp_wrapper_and_tabulates() -> None:
    from bench.strategies import Run, fill, runs_to_do, table
    from strategies.factory import DP_WRAPPERS, STRATEGIES

    runs = runs_to_do()
    assert len(runs) == len(STRATEGIES) + len(DP_WRAPPERS)
    assert {r.overrides.split("'")[1] for r in runs if r.overrides.startswith("strategy=")} == set(STRATEGIES)
    assert [r.label for r in runs_to_do(["lr-decay"])] == ["lr-decay"]  # the example: only when named
    done = fill(Run("krum", "strategy='krum'"), {"status": "completed", "rounds": [
        {"round": 2, "evaluate": {"eval-accuracy": 0.9, "eval-loss": 0.3}, "train": {"train-lr": 0.025}},
        {"round": 1, "evaluate": {"eval-accuracy": 0.5, "eval-loss": 1.0}}]}, 12.0)
    failed = fill(Run("fedyogi", "strategy='fedyogi'"), {"status": "failed", "rounds": [], "error": "boom"}, 3.0)
    text = table([done, failed], 2)
    assert "| krum | `strategy='krum'` | 0.900 | 0.300 | 12 |" in text
    assert done.accuracy == [0.5, 0.9] and done.lr[1] == 0.025
    assert "FAILED (failed)" in text and not failed.ok and done.ok
    assert math.isnan(fill(Run("x", ""), {"status": "completed", "rounds": [{"round": 1, "evaluate": {}}]},
                           0).accuracy[0])


@pytest.mark.slow
def test_bench_strategies_runs_one_strategy_for_real(tmp_path) -> None:
    """``python -m bench.strategies --only fedavg --rounds 1``: one real ``flwr run . local``, its table and JSON."""
    import subprocess

    result = subprocess.run([sys.executable, "-m", "bench.strategies", "--only", "fedavg", "--rounds", "1",
                             "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "strategies.json").read_text())
    (run,) = data["runs"]
    assert run["status"] == "completed" and len(run["accuracy"]) == 1 and 0.0 < run["accuracy"][0] <= 1.0
    assert "| fedavg | `strategy='fedavg'` |" in (tmp_path / "strategies.md").read_text()
    assert Path(tmp_path / "strategies.md").read_text() in result.stdout + "\n"


def test_flower_runs_read_the_history_of_the_run_folder_the_run_made(tmp_path) -> None:
    """bench.flower finds a run's history in ``<output-dir>/<time>-run<id>/`` through ``latest``; an older run's
    history there is not taken for this run's."""
    import os
    import time

    from bench.flower import _new_history
    from splitfed.run.rundirs import new_run_dir

    out = tmp_path / "outputs"
    old = new_run_dir(out, 1)
    (old / "history.json").write_text("{}")
    os.utime(old / "history.json", (time.time() - 60, time.time() - 60))
    since = time.time()
    assert _new_history(out, since) is None  # only an earlier run's: this run wrote none
    new = new_run_dir(out, 2)
    assert _new_history(out, since) is None  # its folder, no history yet
    (new / "history.json").write_text("{}")
    assert _new_history(out, since) == new / "history.json"
    assert _new_history(tmp_path / "nothing", since) is None
