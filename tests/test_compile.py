"""``compile = true`` through the run config and the apps: every part runs compiled (dynamo captures graphs on
both sides), and the checkpoint, the client-state records the clients send, the LoRA adapters and the exported
model all carry the parts' plain state-dict keys (no ``_orig_mod.`` prefix).

In CI the parts compile with the ``aot_eager`` backend: dynamo and AOTAutograd trace every part exactly as with
the default backend, without inductor's C++ code generation (minutes on 2 cores, long enough for a trunk's saved
forward to expire before the client's first backward has compiled). The slow test runs the default (inductor).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from flower_harness import run_apps
from llm_fixtures import save_tiny
from safetensors.torch import load_file

from splitfed.config import RunConfig
from splitfed.models.export import load_exported
from splitfed.models.parts import ALL_ROLES, build_parts, client_state, initial_client_state, trainable_state


def _plain_keys(settings: dict[str, Any]) -> tuple[set[str], set[str]]:
    """The checkpoint's trunk and client keys of the same run without compile."""
    cfg = RunConfig.from_mapping({k.replace("_", "-"): v for k, v in {**settings, "compile": False}.items()})
    split = build_parts(cfg, ALL_ROLES)
    trunk = trainable_state(split.trunk) if cfg.lora_rank else split.trunk.state_dict()
    clients = client_state(split) if cfg.lora_rank else initial_client_state(cfg, split)
    return set(trunk), set(clients)


def _run(tmp_path: Path, **settings: Any) -> tuple[Path, dict[str, Any]]:
    """One round of one node, training only (each message builds its parts anew: each compiles anew)."""
    _, out = run_apps(tmp_path, num_nodes=1, concurrency=1, num_server_rounds=1, local_steps=2, min_train_nodes=1,
                      fraction_evaluate=0.0, compile=True, **settings)
    history = json.loads((out / "history.json").read_text())
    assert history["status"] == "completed" and history["rounds"][0]["train"]["train-steps"] == 2
    return out, history


def _check_plain(out: Path, settings: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    trunk = load_file(str(out / "checkpoint" / "trunk.safetensors"))
    clients = load_file(str(out / "checkpoint" / "clients.safetensors"))
    assert not [k for k in (*trunk, *clients) if "_orig_mod" in k]
    assert (set(trunk), set(clients)) == _plain_keys(settings)
    return trunk, clients


def test_compiled_cnn_run_checkpoints_and_exports_plain_keys(tmp_path: Path, aot_eager: None, graphs: Any) -> None:
    out, _ = _run(tmp_path)
    assert graphs() >= 3  # the server's trunk and the clients' bottom and top ran compiled
    trunk, clients = _check_plain(out, {})
    exported = load_exported(out / "model").state_dict()  # the unsplit CNN, with the trained weights
    assert torch.equal(exported["3.weight"], trunk["layers.0.weight"])
    assert torch.equal(exported["0.weight"], clients["bottom.layers.0.weight"])
    assert torch.equal(exported["9.weight"], clients["top.layers.3.weight"])


def test_compiled_lora_run_exchanges_plain_adapter_keys_and_exports(tmp_path: Path, aot_eager: None,
                                                                    graphs: Any) -> None:
    from transformers import AutoModelForCausalLM

    folder = save_tiny("llama", tmp_path / "ckpt")
    settings = dict(model=str(folder), cuts="1,3", lora_rank=4, max_seq_len=32, batch_size=4)
    out, history = _run(tmp_path, **settings)
    assert graphs() >= 3
    trunk, clients = _check_plain(out, settings)
    assert all("lora_" in k for k in (*trunk, *clients))  # adapters only, by their plain names
    assert 0 < history["rounds"][0]["train"]["train-state-bytes"] < 50_000
    AutoModelForCausalLM.from_pretrained(out / "model")  # the export merged the adapters into a whole model


@pytest.mark.slow
def test_compiled_cnn_run_with_the_default_backend(tmp_path: Path, graphs: Any) -> None:
    out, _ = _run(tmp_path)
    assert graphs() >= 3
    _check_plain(out, {})
    load_exported(out / "model")
