"""What a run prints: Flower's own lines with the metrics a user reads; the trunk's counters in the history."""

from __future__ import annotations

import ast
import json
import logging
import re

import pytest
from flower_harness import run_apps

#: What a round's aggregated records may hold (kebab-case; a researcher's own keys would be kept too).
USER_FACING = {"num-examples"} | {f"{side}-{name}" for side in ("train", "eval") for name in (
    "loss", "accuracy", "seconds", "bytes-sent", "bytes-received", "bytes-shared")}


def _records(caplog: pytest.LogCaptureFixture) -> list[dict[str, float]]:
    """The aggregated MetricRecords Flower logged, parsed back."""
    out = []
    for record in caplog.records:
        message = record.getMessage()
        if "Aggregated MetricRecord" in message:
            out.append(ast.literal_eval(re.sub(r"^.*?Aggregated MetricRecord: ", "", message)))
    return out


def test_each_round_logs_what_a_user_reads_and_the_history_keeps_the_counters(
        tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    ours = logging.getLogger("splitfed")  # its own handler, not propagated: caplog listens beside it
    ours.addHandler(caplog.handler)
    try:
        _, out = run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=1, local_steps=2, eval_batches=2)
    finally:
        ours.removeHandler(caplog.handler)
    train, evaluate = _records(caplog)
    assert {"train-loss", "train-accuracy", "num-examples", "train-bytes-sent"} <= set(train) <= USER_FACING
    assert {"eval-loss", "eval-accuracy", "num-examples"} <= set(evaluate) <= USER_FACING
    (round1,) = json.loads((out / "history.json").read_text())["rounds"]
    assert round1["train"]["train-steps"] == 2 * 2 and round1["train"]["train-trunk-applied"] == 2 * 2
    assert round1["train"]["train-state-bytes"] > 0 and round1["train"]["train-failures"] == 0
    assert round1["train"]["train-loss"] == pytest.approx(train["train-loss"])
    # Membership of the trunk's step group is DEBUG, not a line per client per round.
    assert not [r for r in caplog.records if "trunk step group" in r.getMessage() and r.levelno >= logging.INFO]
    # The run ends saying where its results are, and nothing after it asks for the user's action.
    finished = [r for r in caplog.records if "run finished" in r.getMessage()]
    assert finished and str(out) in finished[-1].getMessage()
    after = caplog.records[caplog.records.index(finished[-1]) + 1:]
    assert not [r for r in after if r.levelno >= logging.WARNING], [r.getMessage() for r in after]
