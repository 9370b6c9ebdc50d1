"""Pretrained models: loading by path or hub id, part-only loading, LoRA on every part, export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import batch_for
from llm_fixtures import VOCAB, save_tiny

from splitfed.errors import ModelLoadError
from splitfed.models.llm import load_model, load_tokenizer, model_dir
from splitfed.models.partload import CheckpointReader, load_parts, parts_nbytes
from splitfed.models.lora import adapter_state, apply_lora, load_adapter_state, lora_config
from splitfed.split import SplitModel, split_model

ARCHS = ["gpt2", "llama", "qwen2", "gemma", "bert"]


def _batch(arch: str):
    ids, mask, labels = batch_for(arch, padded=True)
    return ids.clamp(max=VOCAB - 4), mask, labels.clamp(max=VOCAB - 4) if arch != "bert" else labels


@pytest.mark.parametrize("arch", ARCHS)
def test_part_only_loading_reads_only_its_parts_and_is_exact(tmp_path: Path, arch: str) -> None:
    folder = save_tiny(arch, tmp_path / arch)
    client_reader, server_reader = CheckpointReader(folder), CheckpointReader(folder)
    client = load_parts(str(folder), (1, 3), ("bottom", "top"), reader=client_reader)
    server = load_parts(str(folder), (1, 3), ("trunk",), reader=server_reader)
    # The client never reads (or allocates) a trunk tensor, and the server never reads the client's.
    assert not client_reader.read_keys & server_reader.read_keys
    assert client_reader.read_keys | server_reader.read_keys == set(client_reader.weight_map)
    assert all(p.is_meta for p in client.trunk.parameters())
    assert all(p.is_meta for p in server.bottom.parameters()) and all(p.is_meta for p in server.top.parameters())
    full = split_model(load_model(str(folder)).eval(), (1, 3))
    ids, mask, _ = _batch(arch)
    joined = SplitModel(client.bottom, server.trunk, client.top, task=client.task).eval()
    with torch.no_grad():
        got, want = joined(ids, attention_mask=mask).logits, full(ids, attention_mask=mask).logits
    assert (got - want).abs().max().item() == 0.0


def test_sharded_checkpoints_and_tied_embeddings(tmp_path: Path) -> None:
    folder = save_tiny("gpt2", tmp_path / "g", layers=4, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").exists()
    reader = CheckpointReader(folder)
    client = load_parts(str(folder), (1, 3), ("top",), reader=reader)
    # The top's head is tied to the embedding: read from the embedding's tensor.
    assert any("wte" in k for k in reader.read_keys)
    assert torch.equal(client.top.head.weight, load_model(str(folder)).lm_head.weight)


def test_hub_ids_resolve_through_the_hugging_face_cache(tmp_path: Path, monkeypatch) -> None:
    """The hub code path, offline: a snapshot laid out as huggingface_hub caches it."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny-llama" / "snapshots" / "0123456789abcdef"
    save_tiny("llama", snapshot)
    (cache / "models--acme--tiny-llama" / "refs").mkdir(parents=True)
    (cache / "models--acme--tiny-llama" / "refs" / "main").write_text("0123456789abcdef")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    assert model_dir("acme/tiny-llama") == snapshot
    parts = load_parts("acme/tiny-llama", (1, 3), ("trunk",))
    assert not any(p.is_meta for p in parts.trunk.parameters())
    assert load_tokenizer("acme/tiny-llama").eos_token == "<eos>"
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE"):
        model_dir("acme/not-there")


def test_unknown_local_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        model_dir(str(tmp_path / "empty"))


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2", "gemma"])
def test_lora_trains_only_adapters_on_every_part_over_grpc(tmp_path: Path, arch: str, trunk_server) -> None:
    from splitfed.channel.client.remote import RemoteTrunk

    folder = save_tiny(arch, tmp_path / arch)
    client = load_parts(str(folder), (1, 3), ("bottom", "top"))
    server = load_parts(str(folder), (1, 3), ("trunk",))
    config = lora_config(arch, rank=4)
    for part in (client.bottom, client.top, server.trunk):
        apply_lora(part, config, seed=0)
    frozen_before = {n: p.detach().clone() for n, p in server.trunk.named_parameters() if not p.requires_grad}
    client_frozen = {n: p.detach().clone() for n, p in client.top.named_parameters() if not p.requires_grad}
    assert all("lora_" in n for n, p in server.trunk.named_parameters() if p.requires_grad)
    srv = trunk_server(server.trunk, optimizer="adamw", lr=1e-2)
    model = SplitModel(client.bottom, RemoteTrunk(srv.address, insecure=True), client.top, task="causal-lm")
    before = {k: v.clone() for k, v in adapter_state({"bottom": client.bottom, "top": client.top}).items()}
    trunk_before = {n: p.detach().clone() for n, p in server.trunk.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.client_modules().parameters() if p.requires_grad], lr=1e-2)
    ids, mask, labels = _batch(arch)
    for _ in range(3):
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    after = adapter_state({"bottom": client.bottom, "top": client.top})
    # Only adapters are exchanged, they moved, and no base weight moved anywhere.
    assert before.keys() == after.keys() and all("lora_" in k for k in after)
    assert any(not torch.equal(before[k], after[k]) for k in after)
    assert any(not torch.equal(trunk_before[n], p) for n, p in server.trunk.named_parameters() if p.requires_grad)
    assert all(torch.equal(frozen_before[n], p) for n, p in server.trunk.named_parameters() if not p.requires_grad)
    assert all(torch.equal(client_frozen[n], p) for n, p in client.top.named_parameters() if not p.requires_grad)
    # The exchange round-trips into freshly built parts.
    other = load_parts(str(folder), (1, 3), ("bottom", "top"))
    for part in (other.bottom, other.top):
        apply_lora(part, config, seed=1)
    load_adapter_state({"bottom": other.bottom, "top": other.top}, after)
    assert all(torch.equal(v, adapter_state({"bottom": other.bottom, "top": other.top})[k]) for k, v in after.items())
    full_bytes = sum(p.numel() * p.element_size() for p in model.client_modules().parameters())
    assert sum(t.numel() * t.element_size() for t in after.values()) < full_bytes / 4


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2", "gemma"])
def test_lora_run_exports_a_model_with_the_split_models_logits(tmp_path: Path, arch: str) -> None:
    from flower_harness import run_apps
    from transformers import AutoModelForCausalLM

    from splitfed.config import RunConfig
    from splitfed.models.parts import ALL_ROLES, build_parts, load_client_state

    folder = save_tiny(arch, tmp_path / "ckpt")
    settings = dict(model=str(folder), cuts="1,3", lora_rank=4, max_seq_len=32, batch_size=4, lr=0.01,
                    optimizer="adamw", eval_batches=2)
    _, out = run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=1, local_steps=3, **settings)
    history = json.loads((out / "history.json").read_text())["rounds"][0]
    assert 0 < history["train"]["train-state-bytes"] < 50_000  # adapters only
    exported = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    # The split model as trained: base parts + the checkpointed adapters (trunk and client parts).
    from safetensors.torch import load_file

    cfg = RunConfig.from_mapping({k.replace("_", "-"): v for k, v in settings.items()})
    split = build_parts(cfg, ALL_ROLES)
    split.trunk.load_state_dict(load_file(str(out / "checkpoint" / "trunk.safetensors")), strict=False)
    load_client_state(split, load_file(str(out / "checkpoint" / "clients.safetensors")))
    ids, mask, _ = _batch(arch)
    with torch.no_grad():
        want = split.eval()(ids, attention_mask=mask).logits
        got = exported(input_ids=ids, attention_mask=mask).logits
    assert (got - want)[mask.bool()].abs().max().item() < 1e-5
    assert load_tokenizer(str(out / "model")).eos_token == "<eos>"


PEAK_RSS_SCRIPT = r"""
import json, sys
import torch
from splitfed.models.partload import load_parts, parts_nbytes
# VmHWM, not ru_maxrss: Linux carries the spawning process's peak into ru_maxrss across exec, so a child
# of a large test worker would report the worker's peak.
def status_kb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
base = status_kb("VmRSS")
split = load_parts(sys.argv[1], (2, 22), ("bottom", "top"))
peak = status_kb("VmHWM")
print(json.dumps({"base_kb": base, "peak_kb": peak, "parts_bytes": parts_nbytes(split, ("bottom", "top"))}))
"""

WRITE_MEDIUM = r"""
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel
cfg = GPT2Config(n_layer=24, n_embd=1024, n_head=16, vocab_size=50257, n_positions=1024)
with torch.device("meta"):
    model = GPT2LMHeadModel(cfg)
model = model.to_empty(device="cpu")
for p in model.parameters():
    torch.nn.init.normal_(p, std=0.02)
model.save_pretrained(sys.argv[1], max_shard_size="500MB")
"""


@pytest.mark.slow
def test_client_peak_rss_of_part_only_loading_gpt2_medium(tmp_path: Path) -> None:
    """A client loading its parts of a GPT-2-medium-sized checkpoint: peak RSS growth <= 1.3x its parts."""
    folder = tmp_path / "gpt2-medium"
    subprocess.run([sys.executable, "-c", WRITE_MEDIUM, str(folder)], check=True)
    out = subprocess.run([sys.executable, "-c", PEAK_RSS_SCRIPT, str(folder)], check=True, capture_output=True,
                         text=True, env=dict(os.environ, SPLITFED_TUNE_MALLOC="0"))
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    growth = (stats["peak_kb"] - stats["base_kb"]) * 1024
    ratio = growth / stats["parts_bytes"]
    print(f"part-only loading: parts {stats['parts_bytes'] / 2**20:.0f} MiB, peak RSS growth "
          f"{growth / 2**20:.0f} MiB, ratio {ratio:.2f}")
    assert ratio <= 1.3


@pytest.mark.slow
def test_smollm2_named_model_loads_offline_and_answers() -> None:
    pytest.importorskip("gguf")
    tok = load_tokenizer("smollm2-135m")
    model = load_model("smollm2-135m").eval()
    ids = tok("The capital of France is", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in tok.decode(out[0])
    split = load_parts("smollm2-135m", roles=("trunk",))
    assert parts_nbytes(split, ("trunk",)) > 50e6


@pytest.mark.slow
def test_smollm2_split_greedy_generation_equals_unsplit() -> None:
    from splitfed.client.generation import generate

    tok = load_tokenizer("smollm2-135m")
    ref = load_model("smollm2-135m").eval()
    parts = load_parts("smollm2-135m", roles=("bottom", "trunk", "top"))
    batch = tok(["The capital of France is", "Two plus two equals"], return_tensors="pt", padding=True,
                padding_side="left")
    want = ref.generate(**batch, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    got = generate(parts.bottom, parts.trunk, parts.top, batch["input_ids"], batch["attention_mask"],
                   max_new_tokens=12, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    assert torch.equal(got, want)
