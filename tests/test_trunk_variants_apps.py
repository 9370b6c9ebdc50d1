"""SplitFed V1 and V2 through the real ServerApp, ClientApp and strategy in one process (ThreadGrid transport):
rounds complete, the copies are merged and freed every round, turns serve every client once per round."""

from __future__ import annotations

import json

import pytest
from flower_harness import run_apps

STEPS = 8


def _rounds(out) -> list[dict]:  # type: ignore[no-untyped-def]
    return json.loads((out / "history.json").read_text())["rounds"]


@pytest.mark.parametrize("trunk_strategy", ["", "fedadam"])
def test_per_client_rounds_merge_and_free_one_copy_per_client(tmp_path, trunk_strategy: str) -> None:
    _, out = run_apps(tmp_path, num_nodes=4, concurrency=2, num_server_rounds=2, local_steps=STEPS,
                      trunk_mode="per-client", trunk_strategy=trunk_strategy)
    rounds = _rounds(out)
    assert [r["round"] for r in rounds] == [1, 2]
    for i, r in enumerate(rounds, start=1):
        assert r["trunk"]["trunk-copies"] == 4
        assert r["trunk"]["trunk-copy-examples"] == 4 * STEPS * 32
        assert r["trunk"]["trunk-copies-made"] == r["trunk"]["trunk-copies-freed"] == 4 * i  # freed every round
        assert r["trunk"]["trunk-version"] == i  # one merge a round
        assert r["trunk"]["trunk-applied"] == 4 * STEPS * i
    assert rounds[1]["evaluate"]["eval-loss"] < rounds[0]["train"]["train-loss"]


def test_sequential_rounds_serve_every_client_once_per_round(tmp_path) -> None:
    # Every sampled client must be able to wait for its turn at once: 4 ClientApps run together.
    _, out = run_apps(tmp_path, num_nodes=4, concurrency=4, num_server_rounds=2, local_steps=STEPS,
                      trunk_mode="sequential")
    rounds = _rounds(out)
    assert [r["round"] for r in rounds] == [1, 2]
    for i, r in enumerate(rounds, start=1):
        assert r["trunk"]["trunk-turns"] == 4 * i and r["trunk"]["trunk-skipped-turns"] == 0
        assert r["trunk"]["trunk-version"] == r["trunk"]["trunk-applied"] == 4 * STEPS * i  # every gradient at once
        assert r["trunk"]["trunk-rejected-stale"] == 0
    assert rounds[1]["evaluate"]["eval-loss"] < rounds[0]["train"]["train-loss"]
