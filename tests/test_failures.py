"""Runs whose clients fail look like failures: the run stops with the first client's error, Flower marks it
failed, the history records each round's failures, and nothing is exported from a round that did not train.
A round where only some clients fail goes on, with the failures counted; likewise for evaluations. A round that
cannot start for want of SuperNodes waits ``node-wait-timeout``, then fails saying how to start it. Real
``flwr run``s and the in-process apps; the errors that say what to do next."""

from __future__ import annotations

import json
import textwrap
import tomllib
from pathlib import Path

import pytest
from flower_harness import ROOT, run_apps, run_folder
from llm_fixtures import save_tiny
from test_e2e_flwr import _env, _run_id, flwr_home, flwr_run  # noqa: F401  (flwr_home is a fixture)

from splitfed.errors import ConfigError, ModelLoadError, RoundFailedError
from splitfed.run.report import summary_table


def _history(out: Path) -> dict:
    return json.loads((run_folder(out) / "history.json").read_text())


def _run_status(run_id: str, env: dict[str, str]) -> dict:
    import subprocess

    from test_e2e_flwr import BIN

    result = subprocess.run([str(BIN / "flwr"), "list", "local", "--run-id", run_id, "--format", "json"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
    return json.loads(result.stdout)["runs"][0]


def test_clients_that_all_fail_fail_the_run_with_their_error_and_export_nothing(tmp_path: Path) -> None:
    """Every client raises (a hub dataset offline; the tests run with the hub offline): the run stops after round 1
    of 3 with the clients' error, its type kept, and nothing is exported. (The same through ``flwr run``, where
    Flower marks the run failed with that error, is the slow test below.)"""
    with pytest.raises(RoundFailedError, match=r"round 1: 0 of 2 clients trained.*some-org/some-dataset"):
        run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=3, local_steps=2,
                 dataset="some-org/some-dataset")
    out = tmp_path / "outputs"
    history = _history(out)
    assert history["status"] == "failed" and "0 of 2 clients trained" in history["error"]
    (round1,) = history["rounds"]
    assert round1["round"] == 1 and round1["failures"]["train"] == 2 and round1["failures"]["train-sent"] == 2
    assert "some-org/some-dataset" in round1["failures"]["first-error"]
    assert "could not be loaded" in round1["failures"]["first-error"]
    assert "ConfigError" in round1["failures"]["first-error"]
    assert not (run_folder(out) / "model").exists() and not (run_folder(out) / "checkpoint").exists()


@pytest.mark.slow  # CI: the test above, through the apps in-process
def test_flwr_run_whose_clients_all_fail_is_reported_failed(flwr_home: Path, tmp_path: Path) -> None:
    """Every client raises (a hub dataset offline): the run fails with that error, nothing is exported."""
    env = dict(_env(flwr_home), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    out_dir = tmp_path / "outputs"
    overrides = f"dataset='some-org/some-dataset' num-server-rounds=3 local-steps=2 output-dir='{out_dir}'"
    output = flwr_run([".", "local", "--stream", "--run-config", overrides, "--federation-config",
                       "num-supernodes=2 client-resources-num-cpus=1"], env)
    run = _run_status(_run_id(output), env)
    assert run["status"] == "finished:failed", output[-3000:]
    assert "some-org/some-dataset" in run["status-details"] and "could not be loaded" in run["status-details"]
    history = _history(out_dir)
    assert history["status"] == "failed" and "0 of 2 clients trained" in history["error"]
    (round1,) = history["rounds"]
    assert round1["round"] == 1 and round1["failures"]["train"] == 2 and round1["failures"]["train-sent"] == 2
    assert "some-org/some-dataset" in round1["failures"]["first-error"]
    assert "ConfigError" in round1["failures"]["first-error"]  # the client's exception type survives Flower
    assert not (run_folder(out_dir) / "model").exists() and not (run_folder(out_dir) / "checkpoint").exists()


FAULTY_CLIENT = '''
"""The real ClientApp, except that partition 1 fails in training."""
from flwr.clientapp import ClientApp

from splitfed.apps import client_app as real

app = ClientApp()


@app.train()
def train(msg, context):
    if int(context.node_config["partition-id"]) == 1:
        raise RuntimeError("disk full on partition 1")
    return real.train(msg, context)


@app.evaluate()
def evaluate(msg, context):
    return real.evaluate(msg, context)
'''


@pytest.mark.slow
def test_flwr_run_with_one_of_three_clients_failing_goes_on(flwr_home: Path, tmp_path: Path) -> None:
    """One client of three raises in every round: the run completes and every round counts one failure."""
    app = tmp_path / "faulty-app"
    app.mkdir()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    config = "\n".join(f"{k} = {json.dumps(v)}" for k, v in project["tool"]["flwr"]["app"]["config"].items())
    (app / "pyproject.toml").write_text(textwrap.dedent('''
        [build-system]
        requires = ["setuptools>=69"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "faulty-splitfed"
        version = "0.1.0"
        dependencies = []

        [tool.flwr.app]
        publisher = "splitfed"

        [tool.flwr.app.components]
        serverapp = "splitfed.apps.server_app:app"
        clientapp = "faulty_client:app"

        [tool.flwr.app.config]
        ''') + config + "\n")
    (app / "faulty_client.py").write_text(FAULTY_CLIENT)
    env = _env(flwr_home)
    out_dir = tmp_path / "outputs"
    overrides = f"num-server-rounds=2 local-steps=5 trunk-timeout=10.0 output-dir='{out_dir}'"
    output = flwr_run([str(app), "local", "--stream", "--run-config", overrides, "--federation-config",
                       "num-supernodes=3 client-resources-num-cpus=1"], env)
    run = _run_status(_run_id(output), env)
    assert run["status"] == "finished:completed", output[-3000:]
    history = _history(out_dir)
    assert history["status"] == "completed" and [r["round"] for r in history["rounds"]] == [1, 2]
    for record in history["rounds"]:
        assert record["failures"]["train"] == 1 and record["failures"]["train-sent"] == 3
        assert record["failures"]["first-error"].endswith("disk full on partition 1")
        assert record["train"]["train-failures"] == 1
        assert record["train"]["train-steps"] == 2 * 5  # the two healthy clients trained
    assert (run_folder(out_dir) / "model" / "model.safetensors").exists()
    table = summary_table(history)
    assert "failed" in table.splitlines()[0] and "1/3" in table.splitlines()[2]


# -- in process (the same apps, no Ray) ------------------------------------------------------------
def _fail_partitions(monkeypatch: pytest.MonkeyPatch, failing: set[int], after: int = 0) -> None:
    import apps.client_app as client_app

    real = client_app.client_train

    def flaky(cfg, state, trunk, splits, server_round, partition_id, **kwargs):
        if partition_id in failing and server_round > after:
            raise RuntimeError(f"device unplugged on partition {partition_id}")
        return real(cfg, state, trunk, splits, server_round, partition_id, **kwargs)

    monkeypatch.setattr(client_app, "client_train", flaky)


def test_a_round_with_too_few_clients_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch
                                                                                         ) -> None:
    # Round 1 trains; from round 2 on, two of three clients fail (min-train-nodes = 2).
    _fail_partitions(monkeypatch, {0, 2}, after=1)
    with pytest.raises(RoundFailedError, match=r"round 2: 1 of 3 clients trained, 2 needed.*device unplugged"):
        run_apps(tmp_path, num_nodes=3, concurrency=3, num_server_rounds=3, local_steps=2)
    out = tmp_path / "outputs"
    history = _history(out)
    assert history["status"] == "failed" and [r["round"] for r in history["rounds"]] == [1, 2]
    assert history["rounds"][0]["failures"] == {"train": 0, "train-sent": 3, "evaluate": 0, "evaluate-sent": 3}
    assert history["rounds"][1]["failures"]["train"] == 2
    assert "RuntimeError: device unplugged on partition" in history["rounds"][1]["failures"]["first-error"]
    # The checkpoint is still round 1's, and no model was exported.
    assert json.loads((run_folder(out) / "checkpoint" / "state.json").read_text())["round"] == 1
    assert not (run_folder(out) / "model").exists()
    assert "run failed: round 2" in summary_table(history)


def test_accept_failures_sets_how_many_clients_may_fail(tmp_path, monkeypatch) -> None:
    # One of three fails: fine under the default (0.5), fatal when no failure is accepted.
    _fail_partitions(monkeypatch, {1})
    with pytest.raises(RoundFailedError, match="accept-failures = 0.0"):
        run_apps(tmp_path / "strict", num_nodes=3, concurrency=3, num_server_rounds=1, local_steps=2,
                 accept_failures=0.0)
    _, out = run_apps(tmp_path / "default", num_nodes=3, concurrency=3, num_server_rounds=1, local_steps=2)
    (round1,) = _history(out)["rounds"]
    assert round1["failures"]["train"] == 1 and round1["train"]["train-failures"] == 1
    assert round1["train"]["train-steps"] == 2 * 2


def _fail_evaluation(monkeypatch: pytest.MonkeyPatch, nodes: set[str]) -> None:
    """Evaluation raises on these nodes (``node-<id>``; the harness's partition i is node 100 + i)."""
    import apps.client_app as client_app

    real = client_app.client_evaluate

    def flaky(cfg, state, trunk, splits, **kwargs):
        if trunk.client.client_id in nodes:
            raise RuntimeError(f"evaluation data unreadable on {trunk.client.client_id}")
        return real(cfg, state, trunk, splits, **kwargs)

    monkeypatch.setattr(client_app, "client_evaluate", flaky)


def test_a_round_whose_every_evaluation_fails_stops_the_run(tmp_path, monkeypatch) -> None:
    _fail_evaluation(monkeypatch, {"node-100", "node-101"})
    with pytest.raises(RoundFailedError, match=r"round 1: all 2 clients failed to evaluate.*evaluation data "
                                               r"unreadable"):
        run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=2, local_steps=2, eval_batches=1)
    out = tmp_path / "outputs"
    history = _history(out)
    assert history["status"] == "failed" and "all 2 clients failed to evaluate" in history["error"]
    assert history["rounds"][-1]["failures"]["evaluate"] == 2 and history["rounds"][-1]["failures"]["train"] == 0
    assert not (run_folder(out) / "model").exists()  # no round 2, nothing exported
    assert {r["round"] for r in history["rounds"]} == {1}


def test_failed_evaluations_are_counted_and_the_round_goes_on(tmp_path, monkeypatch) -> None:
    _fail_evaluation(monkeypatch, {"node-101"})
    _, out = run_apps(tmp_path, num_nodes=3, concurrency=3, num_server_rounds=1, local_steps=2, eval_batches=1)
    history = _history(out)
    assert history["status"] == "completed"
    (round1,) = history["rounds"]
    assert round1["evaluate"]["eval-failures"] == 1
    assert round1["failures"]["evaluate"] == 1 and round1["failures"]["evaluate-sent"] == 3
    assert round1["failures"]["first-error"].endswith("evaluation data unreadable on node-101")
    assert round1["evaluate"]["num-examples"] == 2 * 32  # the two healthy clients' one batch each
    assert round1["train"]["train-failures"] == 0


# -- too few SuperNodes ----------------------------------------------------------------------------
@pytest.mark.timeout(120)  # Flower's own sampling waits forever
def test_a_round_without_enough_supernodes_fails_saying_how_to_start(tmp_path) -> None:
    with pytest.raises(RoundFailedError) as info:
        run_apps(tmp_path, num_nodes=1, concurrency=1, num_server_rounds=1, local_steps=2, node_wait_timeout=1.0)
    message = str(info.value)
    assert "1 SuperNode(s) connected after 1 s" in message and "train needs 2 (min-train-nodes = 2)" in message
    assert 'num-supernodes=2' in message and '--run-config "min-train-nodes=1"' in message
    history = _history(tmp_path / "outputs")
    assert history["status"] == "failed" and history["error"] == message
    assert not (tmp_path / "outputs" / "model").exists()


def test_a_round_waits_for_a_supernode_that_connects_late(tmp_path) -> None:
    import threading

    def second_node_late(grid) -> None:
        grid.offline.add(101)
        threading.Timer(2.0, grid.offline.discard, args=(101,)).start()

    _, out = run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=1, local_steps=2, eval_batches=1,
                      on_grid=second_node_late)
    (round1,) = _history(out)["rounds"]
    assert round1["failures"]["train-sent"] == 2 and round1["train"]["train-steps"] == 2 * 2


def test_one_supernode_trains_with_min_train_nodes_one(tmp_path) -> None:
    _, out = run_apps(tmp_path, num_nodes=1, concurrency=1, num_server_rounds=1, local_steps=2, eval_batches=1,
                      min_train_nodes=1, node_wait_timeout=1.0)
    (round1,) = _history(out)["rounds"]
    assert round1["train"]["train-steps"] == 2 and round1["evaluate"]["num-examples"] == 32


@pytest.mark.slow
def test_flwr_run_with_one_supernode_fails_saying_how_to_start(flwr_home: Path, tmp_path: Path) -> None:
    """The default min-train-nodes (2) and a federation of one SuperNode: the run ends failed, and says why."""
    env = _env(flwr_home)
    out_dir = tmp_path / "outputs"
    output = flwr_run([".", "local", "--stream", "--run-config", f"node-wait-timeout=5.0 output-dir='{out_dir}'",
                       "--federation-config", "num-supernodes=1 client-resources-num-cpus=1"], env)
    run = _run_status(_run_id(output), env)
    assert run["status"] == "finished:failed", output[-3000:]
    assert "1 SuperNode(s) connected" in run["status-details"] and "min-train-nodes=1" in run["status-details"]
    assert _history(out_dir)["status"] == "failed"


@pytest.mark.slow
def test_flwr_run_with_one_supernode_and_min_train_nodes_one_completes(flwr_home: Path, tmp_path: Path) -> None:
    env = _env(flwr_home)
    out_dir = tmp_path / "outputs"
    output = flwr_run([".", "local", "--stream", "--run-config",
                       f"min-train-nodes=1 num-server-rounds=1 local-steps=4 output-dir='{out_dir}'",
                       "--federation-config", "num-supernodes=1 client-resources-num-cpus=1"], env)
    assert _run_status(_run_id(output), env)["status"] == "finished:completed", output[-3000:]
    assert _history(out_dir)["rounds"][0]["train"]["train-steps"] == 4


# -- errors that say what to do next ---------------------------------------------------------------
def test_a_model_folder_without_a_tokenizer_names_the_folder_and_the_fix(tmp_path: Path) -> None:
    from splitfed.models.llm import load_tokenizer

    folder = save_tiny("llama", tmp_path / "model")
    for path in folder.glob("tokenizer*"):
        path.unlink()
    (folder / "special_tokens_map.json").unlink(missing_ok=True)
    with pytest.raises(ModelLoadError, match="no tokenizer") as info:
        load_tokenizer(str(folder))
    assert str(folder) in str(info.value) and "save it beside the weights" in str(info.value)


def test_an_empty_shard_says_whether_the_data_or_the_partitioning_is_empty() -> None:
    from datasets import Dataset

    from splitfed.data import make_partitioner, partition

    empty = Dataset.from_dict({"image": [], "label": []})
    with pytest.raises(ConfigError, match="the dataset itself is empty"):
        partition(empty, make_partitioner("iid", 2), 0)
    tiny = Dataset.from_dict({"image": [[0.0]] * 3, "label": [0, 1, 2]})
    with pytest.raises(ConfigError, match="partition 4 of 5 is empty although the dataset has 3 rows"):
        partition(tiny, make_partitioner("iid", 5), 4)
