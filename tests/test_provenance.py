"""A checkpoint belongs to its run: it records the app, model, cuts, strategy and a digest of the settings that
shape training, and ``resume = true`` from another run's checkpoint is refused naming what differs. Where outputs
go: a relative ``output-dir`` is taken from $SPLITFED_OUTPUT_ROOT, else the SuperLink's working directory."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from flower_harness import default_run_config, run_apps

from splitfed.run.checkpoint import CURRENT, STATE
from splitfed.config import RunConfig
from splitfed.errors import CheckpointMismatchError
from splitfed.run.provenance import RunIdentity
from splitfed.run.server import ServerRunner


def _runner(out: Path, *, app: str = "splitfed/splitfed", strategy_class: str = "FedAvg", **settings: object
            ) -> ServerRunner:
    cfg = RunConfig.from_mapping(default_run_config(output_dir=str(out), **settings))
    return ServerRunner(cfg, app=app, strategy_class=strategy_class)


def test_a_checkpoint_records_the_run_that_made_it(tmp_path: Path) -> None:
    runner = _runner(tmp_path, lr=0.1)
    runner.checkpoint(1)
    doc = json.loads((tmp_path / CURRENT / STATE).read_text())["run"]
    assert (doc["app"], doc["model"], doc["cuts"], doc["strategy"]) == ("splitfed/splitfed", "mnist-cnn", [3, 6],
                                                                         "fedavg (FedAvg)")
    assert doc["settings"]["lr"] == 0.1 and "trunk-port" not in doc["settings"]
    assert doc["config-digest"] == runner.identity.digest and len(doc["config-digest"]) == 64


@pytest.mark.parametrize(("change", "named"), [
    ({"strategy": "fedprox"}, "strategy 'fedavg (FedAvg)' there, 'fedprox (FedAvg)' here"),
    ({"strategy_class": "ClippedFedAvg"}, "strategy 'fedavg (FedAvg)' there, 'fedavg (ClippedFedAvg)' here"),
    ({"app": "someone/other-app"}, "app 'splitfed/splitfed' there, 'someone/other-app' here"),
    ({"lr": 0.1}, "lr = 0.05 there, 0.1 here"),
    ({"trunk_mode": "async"}, "trunk-mode = 'sync' there, 'async' here"),
    ({"cuts": "2,6"}, "cuts 3,6 there, 2,6 here"),
])
def test_resume_from_another_runs_checkpoint_is_refused_naming_the_difference(tmp_path: Path, change: dict,
                                                                               named: str) -> None:
    _runner(tmp_path).checkpoint(1)
    with pytest.raises(CheckpointMismatchError) as caught:
        _runner(tmp_path, resume=True, **change)
    assert named in str(caught.value) and str(tmp_path) in str(caught.value)
    assert "SPLITFED_OUTPUT_ROOT" in str(caught.value) and "resume = false" in str(caught.value)


def test_resume_may_change_what_does_not_shape_training(tmp_path: Path) -> None:
    _runner(tmp_path).checkpoint(1)
    resumed = _runner(tmp_path, resume=True, num_server_rounds=9, trunk_port=0, log_level="DEBUG", auth=False,
                      trunk_timeout=5.0, app="", strategy_class="")  # the Python API knows neither
    assert resumed.round_offset == 1 and resumed.rounds_left == 8


def test_a_checkpoint_from_before_run_records_is_checked_by_model_and_cuts(tmp_path: Path, caplog) -> None:
    _runner(tmp_path).checkpoint(1)
    state = tmp_path / CURRENT / STATE
    meta = json.loads(state.read_text())
    del meta["run"]
    state.write_text(json.dumps(meta))  # state.json is not among the hashed files
    with caplog.at_level(logging.WARNING, logger="splitfed.run.provenance"):
        assert _runner(tmp_path, resume=True, lr=0.1).round_offset == 1
    assert "predates run records" in caplog.text
    with pytest.raises(CheckpointMismatchError, match=r"mnist-cnn cut at \[3, 6\], not mnist-cnn cut at \[2, 6\]"):
        _runner(tmp_path, resume=True, cuts="2,6")


def test_a_fresh_run_says_it_replaces_another_runs_checkpoint(tmp_path: Path, caplog) -> None:
    _runner(tmp_path).checkpoint(1)
    with caplog.at_level(logging.WARNING, logger="splitfed.run.server"):
        _runner(tmp_path, strategy="fedprox")
    assert "holds the checkpoint of another run (strategy 'fedavg (FedAvg)' there" in caplog.text


def test_the_apps_refuse_to_resume_another_strategys_run(tmp_path: Path) -> None:
    """The user's path: a run, then ``resume = true`` with another strategy in the same output-dir."""
    _, out = run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=1, local_steps=2)
    saved = RunIdentity.from_meta(json.loads((out / CURRENT / STATE).read_text()))
    assert saved is not None and saved.strategy == "fedavg (FedAvg)"
    with pytest.raises(CheckpointMismatchError, match="strategy 'fedavg \\(FedAvg\\)' there, 'fedprox \\(FedProx\\)'"):
        run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=2, local_steps=2, resume=True,
                 strategy="fedprox")


@pytest.mark.parametrize("root", [None, "elsewhere"])
def test_a_relative_output_dir_is_taken_from_the_output_root_else_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog, root: str | None) -> None:
    from apps.server_app import output_dir
    from strategies.run import root_note

    monkeypatch.chdir(tmp_path)
    if root is None:
        monkeypatch.delenv("SPLITFED_OUTPUT_ROOT", raising=False)
    else:
        monkeypatch.setenv("SPLITFED_OUTPUT_ROOT", str(tmp_path / root))
    path = output_dir(RunConfig(output_dir="outputs"))
    assert path == (tmp_path / root / "outputs" if root else tmp_path / "outputs")
    # The run's first line names its folder and says where a relative output-dir was taken from.
    assert ("$SPLITFED_OUTPUT_ROOT)" if root else "the SuperLink's working directory") in \
        root_note(RunConfig(output_dir="outputs"))
    assert output_dir(RunConfig(output_dir=str(tmp_path / "abs"))) == tmp_path / "abs"
    assert root_note(RunConfig(output_dir=str(tmp_path / "abs"))) == ""
