"""A SplitFed run with trunk replicas: the ServerApp spreads its nodes over 2 gloo replicas, rank 0 checkpoints, and
a resumed run's replicas start from the checkpoint (weights and optimizer state) and stay identical."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
from flower_harness import default_run_config, run_apps

from splitfed.channel.client.trunk import TrunkClient
from splitfed.config import RunConfig
from splitfed.errors import ConfigError
from splitfed.run.server import ServerRunner
from splitfed.split.base import CutState


def _sync_step(runner: ServerRunner, step: int) -> None:
    """One sync step: a client on each replica, MNIST-shaped activations from the bottom part."""
    clients = [TrunkClient(runner.replicas.address_for(node), insecure=True, client_id=f"c{node}") for node in (1, 2)]
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        states = [runner.split.bottom(torch.randn(4, 1, 28, 28, generator=g)) for _ in clients]
    acts = [f"s{step}-{i}" for i in range(len(clients))]
    outs = [tc.forward(CutState(state.hidden), activation_id=act, train=True, num_examples=4)[0]
            for tc, state, act in zip(clients, states, acts)]
    errors: list[BaseException] = []

    def back(tc: TrunkClient, act: str, out: torch.Tensor) -> None:
        try:
            tc.backward(act, torch.randn(out.shape, generator=torch.Generator().manual_seed(len(act))) * 0.01)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=back, args=args) for args in zip(clients, acts, outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for tc in clients:
        tc.leave()
        tc.close()


def test_the_apps_run_with_two_trunk_replicas_and_resume_with_them(tmp_path: Path) -> None:
    # Execute: the main job, shortened, with trunk-replicas = 2.
    grid, out = run_apps(tmp_path, num_nodes=4, concurrency=4, num_server_rounds=2, local_steps=8, trunk_replicas=2)
    # Assert: every node kept its replica, two nodes on each; the run trained and rank 0 wrote the checkpoint.
    history = json.loads((out / "history.json").read_text())
    assert history["status"] == "completed" and [r["round"] for r in history["rounds"]] == [1, 2]
    by_node = {(m.metadata.dst_node_id, m.content["config"]["splitfed.trunk-address"]) for m in grid.sent}
    assert len({node for node, _ in by_node}) == len(by_node) == 4
    assert sorted(Counter(address for _, address in by_node).values()) == [2, 2]
    rounds = history["rounds"]
    assert rounds[1]["evaluate"]["eval-loss"] < rounds[0]["train"]["train-loss"]
    assert rounds[1]["trunk"]["trunk-version"] == rounds[1]["trunk"]["trunk-steps"] >= 2 * 8
    assert rounds[1]["trunk"]["trunk-replicas-live"] == 2
    saved = json.loads((out / "checkpoint" / "state.json").read_text())
    assert saved["round"] == 2 and saved["trunk-version"] == rounds[1]["trunk"]["trunk-version"]
    # Execute: a restarted server resumes with 2 replicas and takes a sync step with a client on each.
    settings = {"output_dir": str(out), "trunk_replicas": 2, "auth": False, "resume": True, "num_server_rounds": 3,
                "local_steps": 8}  # the run's own settings
    cfg = RunConfig.from_mapping(default_run_config(**settings))
    assert cfg.momentum > 0  # the trunk's SGD has momentum: optimizer state in the checkpoint
    resumed = ServerRunner(cfg).start()
    try:
        assert resumed.round_offset == 2 and resumed.runtime.version == saved["trunk-version"]
        assert resumed.replicas.group.divergence(timeout=30) == 0.0
        _sync_step(resumed, 0)
        # Assert: both replicas applied the same momentum update (replica 1 read the optimizer state too).
        assert resumed.runtime.version == saved["trunk-version"] + 1
        assert resumed.replicas.group.divergence(timeout=30) <= 1e-6
    finally:
        resumed.stop()


def test_replica_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="trunk-replicas must be >= 1"):
        RunConfig.from_mapping(default_run_config(trunk_replicas=0))
    with pytest.raises(ConfigError, match="trunk-replicas = 2 needs trunk-mode"):
        RunConfig.from_mapping(default_run_config(trunk_replicas=2, trunk_mode="per-client"))
    with pytest.raises(ConfigError, match="client-cuts"):
        RunConfig.from_mapping(default_run_config(trunk_replicas=2, client_cuts="1,3 2,3"))
