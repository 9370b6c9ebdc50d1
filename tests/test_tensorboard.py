"""``tensorboard-dir``: every round's metrics go to TensorBoard event files beside the PNG plots."""

from __future__ import annotations

import json

import pytest
from flower_harness import run_apps

pytest.importorskip("tensorboard")


def test_every_rounds_metrics_are_in_the_event_file(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out = run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=2, local_steps=3,
                      tensorboard_dir="tensorboard")
    history = json.loads((out / "history.json").read_text())
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/train-loss", "evaluate/eval-accuracy", "trunk/trunk-version", "round/seconds",
            "failures/train"} <= tags
    for section, key in [("train", "train-loss"), ("evaluate", "eval-loss"), ("evaluate", "eval-accuracy"),
                         ("trunk", "trunk-version"), ("train", "train-bytes-sent")]:
        scalars = events.Scalars(f"{section}/{key}")
        assert [s.step for s in scalars] == [1, 2]
        assert [s.value for s in scalars] == pytest.approx([r[section][key] for r in history["rounds"]], rel=1e-6)
    assert (out / "loss.png").exists() and (out / "tensorboard").parent == out  # beside the plots
