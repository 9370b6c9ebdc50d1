"""The ServerApp, ClientApp and SplitFed strategy together, in one process (ThreadGrid transport)."""

from __future__ import annotations

import json
import socket
import tomllib

import pytest
import torch
from flower_harness import ROOT, default_run_config, run_apps

from splitfed.config import RunConfig
from splitfed.errors import ConfigError
from splitfed.models.export import load_exported


def test_pyproject_config_lists_every_setting() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    parsed = RunConfig.from_mapping(config)
    assert set(config) == set(parsed.to_mapping())


@pytest.mark.parametrize("key, value, fragment", [
    ("trunk-mode", "eventually", "trunk-mode"), ("quorum", 0, "quorum"), ("lr", -1.0, "lr"),
    ("cuts", "3", "cuts"), ("partitioner", "random", "partitioner"), ("batch-size", "many", "batch-size"),
    ("no-such-key", 1, "no-such-key"), ("fraction-train", 1.5, "fraction-train"),
    ("trunk-advertise", "hostonly", "trunk-advertise"), ("auth", "maybe", "auth"),
])
def test_bad_config_values_name_the_key(key: str, value: object, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        RunConfig.from_mapping(default_run_config(**{key: value}))


def test_a_run_config_offers_bulk_links_on_a_plaintext_trunk_and_its_clients_open_them(
        tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    from splitfed.client.round import connect_trunk
    from splitfed.config import RunConfig
    from splitfed.run.server import ServerRunner

    # Bulk links (splitfed.channel.transports.bulk.links; tests/test_bulk.py): offered by a plaintext trunk, opened by its clients.
    with pytest.raises(ConfigError, match="bulk-connections"):
        RunConfig.from_mapping(default_run_config(bulk_connections=-1))
    with pytest.raises(ConfigError, match="trunk-replicas = 1"):
        RunConfig.from_mapping(default_run_config(bulk_connections=2, trunk_replicas=2))
    with pytest.raises(ConfigError, match="bulk-port"):
        RunConfig.from_mapping(default_run_config(bulk_port=65536))
    with socket.socket() as probe:  # a port free now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cfg = RunConfig.from_mapping(default_run_config(bulk_connections=2, bulk_port=port, output_dir=str(tmp_path)))
    runner = ServerRunner(cfg, output_dir=tmp_path).start()
    try:
        assert runner.server.bulk is not None and runner.server.bulk.max_connections == 2
        assert runner.server.bulk.port == port
        remote = connect_trunk(cfg, runner.server.address, runner.tokens.issue(1, 1), "node-1")
        assert remote.client.bulk.connections == 2
        assert remote.client.bulk.ready(gpu=False) is not None and runner.server.bulk.links == 1
        remote.close()
    finally:
        runner.server.stop(grace=0)


def test_a_tls_trunks_run_config_offers_tls_bulk_links_and_its_clients_open_them(tmp_path) -> None:
    import ssl

    from pki import make_pki

    from splitfed.client.round import connect_trunk
    from splitfed.run.server import ServerRunner

    # The operator's certificate with client certificates required: the links verify and present the same.
    pki = make_pki(tmp_path / "pki", nodes=1)
    keys = {"tls_cert": pki.cert("server"), "tls_key": pki.key("server"), "tls_root_ca": pki.cert("ca"),
            "tls_client_ca": pki.cert("ca"), "tls_client_cert": pki.cert("node-0"),
            "tls_client_key": pki.key("node-0")}
    cfg = RunConfig.from_mapping(default_run_config(bulk_connections=2, output_dir=str(tmp_path), **keys))
    runner = ServerRunner(cfg, output_dir=tmp_path).start()
    try:
        assert runner.server.bulk is not None and runner.server.bulk.tls is not None
        remote = connect_trunk(cfg, runner.server.address, runner.tokens.issue(1, 1), "node-1")
        link = remote.client.bulk.ready(gpu=False)
        assert link is not None and runner.server.bulk.links == 1
        assert all(isinstance(s, ssl.SSLSocket) for s in [*link.socks, *link.out_socks])
        assert all(s.getpeercert() for s in link.socks)  # the server's certificate, verified
        remote.close()
    finally:
        runner.server.stop(grace=0)


def _history(out) -> dict:
    return json.loads((out / "history.json").read_text())


@pytest.mark.parametrize("mode", ["sync", "async", "quorum"])
def test_apps_run_rounds_in_every_trunk_mode(tmp_path, mode: str) -> None:
    grid, out = run_apps(tmp_path, num_nodes=4, concurrency=2, num_server_rounds=2, local_steps=8, trunk_mode=mode,
                         quorum=2)
    rounds = _history(out)["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert r["train"]["train-steps"] == 4 * 8
        assert r["train"]["num-examples"] == 4 * 8 * 32
        assert r["evaluate"]["num-examples"] == 1000  # each client evaluates its share of the test split
        assert r["train"]["train-bytes-sent"] > 0
    trunk = rounds[-1]["trunk"]
    applied = trunk["trunk-applied"] + trunk["trunk-downweighted"]
    assert applied + trunk["trunk-rejected-stale"] == 2 * 4 * 8
    assert trunk["trunk-version"] == trunk["trunk-steps"] > 0
    if mode == "async":
        assert trunk["trunk-steps"] == applied
    assert rounds[1]["evaluate"]["eval-loss"] < rounds[0]["train"]["train-loss"]
    # Every train message carried the trunk address and a per-node token.
    train_msgs = [m for m in grid.sent if m.metadata.message_type == "train"]
    tokens = {m.content["config"]["splitfed.trunk-token"] for m in train_msgs}
    assert len(tokens) == len(train_msgs) == 8


def test_exported_model_is_the_trained_split_model(tmp_path) -> None:
    _, out = run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=1, local_steps=4)
    model = load_exported(out / "model").eval()
    from safetensors.torch import load_file

    trunk = load_file(str(out / "checkpoint" / "trunk.safetensors"))
    clients = load_file(str(out / "checkpoint" / "clients.safetensors"))
    state = model.state_dict()
    assert torch.equal(state["3.weight"], trunk["layers.0.weight"])  # first trunk conv
    assert torch.equal(state["0.weight"], clients["bottom.layers.0.weight"])
    assert torch.equal(state["9.weight"], clients["top.layers.3.weight"])


def test_resume_continues_from_the_last_completed_round(tmp_path) -> None:
    from safetensors.torch import load_file

    from splitfed.run.server import ServerRunner

    _, out = run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=1, local_steps=4)
    saved = load_file(str(out / "checkpoint" / "trunk.safetensors"))
    version_one = json.loads((out / "checkpoint" / "state.json").read_text())["trunk-version"]
    # A restarted server starts from the checkpointed trunk, optimizer and round.
    cfg = RunConfig.from_mapping(default_run_config(output_dir=str(out), resume=True, num_server_rounds=3,
                                                    local_steps=4))  # the run's own settings
    runner = ServerRunner(cfg, output_dir=out)
    assert runner.round_offset == 1 and runner.rounds_left == 2 and runner.runtime.version == version_one
    assert all(torch.equal(v, runner.runtime.trunk.state_dict()[k]) for k, v in saved.items())
    # And the apps run only the remaining rounds, numbered 2 and 3.
    grid, out = run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=3, local_steps=4, resume=True)
    rounds = _history(out)["rounds"]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert sorted({int(m.content["config"]["splitfed.server-round"]) for m in grid.sent}) == [2, 3]
    assert rounds[2]["trunk"]["trunk-version"] == version_one + rounds[2]["trunk"]["trunk-steps"]


def test_a_failing_client_does_not_stop_the_round(tmp_path, monkeypatch) -> None:
    import apps.client_app as client_app

    real = client_app.client_train

    def flaky(cfg, state, trunk, splits, server_round, partition_id, **kwargs):
        if partition_id == 1:
            raise RuntimeError("device unplugged")
        return real(cfg, state, trunk, splits, server_round, partition_id, **kwargs)

    monkeypatch.setattr(client_app, "client_train", flaky)
    _, out = run_apps(tmp_path, num_nodes=3, concurrency=3, num_server_rounds=1, local_steps=4, trunk_timeout=5.0)
    round1 = _history(out)["rounds"][0]
    assert round1["train"]["train-steps"] == 2 * 4


@pytest.mark.parametrize("strategy, selected", [("fedprox", 3), ("fedadam", 3), ("fedavgm", 3), ("krum", 1),
                                                ("fedmedian", 3)])
def test_other_flower_strategies_aggregate_the_client_parts(tmp_path, strategy: str, selected: int) -> None:
    _, out = run_apps(tmp_path, num_nodes=3, concurrency=3, num_server_rounds=1, local_steps=3, strategy=strategy)
    # Krum keeps the single most central client's update (and its metrics).
    assert _history(out)["rounds"][0]["train"]["train-steps"] == 3 * selected
