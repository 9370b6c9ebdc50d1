"""Shared fixtures: tiny models of every supported architecture, and a trunk server on loopback."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
# Each trunk server's start would collect (0.2 s here) and freeze the whole test session's heap
# (splitfed.tuning.freeze_heap); tests/test_heap.py turns it on where it is what is tested.
os.environ.setdefault("SPLITFED_FREEZE_HEAP", "0")
# Every test meets the model cache as a first-time user does: empty at the session's start (a conversion, e.g.
# SmolLM2's GGUF, runs once per session and is reused by the tests after it), never the user's ~/.cache/splitfed.
os.environ.setdefault("SPLITFED_CACHE", tempfile.mkdtemp(prefix="splitfed-cache-"))
logging.getLogger("transformers").setLevel(logging.ERROR)

#: The most test workers ``-n auto`` (pyproject's addopts) starts: one per core up to this.
MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """One worker per core, at most :data:`MAX_WORKERS` (each worker's tests start servers and processes of their
    own; past four they mostly wait on each other)."""
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))


VOCAB = 97
ARCHS = ("gpt2", "llama", "qwen2", "qwen3", "gemma", "mistral", "bert")


def tiny_config(arch: str, layers: int = 4, attn: str = "sdpa"):
    """A tiny config of ``arch`` with dropout off (so split and unsplit training match exactly)."""
    import transformers as tf

    common = dict(num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  vocab_size=VOCAB, max_position_embeddings=64)
    if arch == "gpt2":
        cfg = tf.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    elif arch == "llama":
        cfg = tf.LlamaConfig(num_key_value_heads=2, **common)
    elif arch == "qwen2":
        # Sliding-window layers from layer 2 on, so both mask kinds cross cuts.
        cfg = tf.Qwen2Config(num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
                             max_window_layers=2, **common)
    elif arch == "gemma":
        cfg = tf.GemmaConfig(num_key_value_heads=2, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                             **common)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(num_key_value_heads=2, head_dim=8, **common)
    elif arch == "mistral":
        cfg = tf.MistralConfig(num_key_value_heads=2, sliding_window=None, **common)
    elif arch == "bert":
        cfg = tf.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
                            classifier_dropout=0.0, **common)
    else:
        raise ValueError(arch)
    cfg._attn_implementation = attn
    return cfg


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread: tiny models run fastest so, and do not oversubscribe a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_model(arch: str, layers: int = 4, attn: str = "sdpa", seed: int = 0) -> nn.Module:
    """A tiny randomly initialised model of ``arch`` in eval mode."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tiny_config(arch, layers, attn)
    cls = tf.BertForSequenceClassification if arch == "bert" else tf.AutoModelForCausalLM
    model = cls(cfg) if arch == "bert" else cls.from_config(cfg)
    return model.eval()


def spread_model(arch: str) -> nn.Module:
    """A tiny model whose weights are spread wide enough that greedy decoding does not repeat one token."""
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def tiny_cnn(seed: int = 0) -> nn.Sequential:
    """The MNIST CNN at small size."""
    from splitfed.models.catalog import mnist_cnn

    torch.manual_seed(seed)
    return mnist_cnn(width=4)


def batch_for(arch: str, batch: int = 3, length: int = 12, padded: bool = False, seed: int = 1):
    """Token ids, an attention mask (left padding for decoders, right for BERT) and labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if padded:
        for i in range(1, batch):
            mask[i, : 2 * i] = 0
        if arch == "bert":
            mask = mask.flip(-1)
    labels = torch.randint(0, 3, (batch,), generator=g) if arch == "bert" else ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


@pytest.fixture
def trunk_server() -> Iterator[Callable[..., object]]:
    """Factory: start a TrunkServer on loopback for a trunk; stopped after the test."""
    from splitfed.channel.server.trunkserver import TrunkServer

    servers = []

    def start(trunk: nn.Module, **kwargs: object) -> TrunkServer:
        kwargs.setdefault("insecure", True)
        server = TrunkServer(trunk, **kwargs).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(grace=0)


@pytest.fixture
def graphs() -> Iterator[Callable[[], int]]:
    """Counts of what dynamo compiled during the test (its ``unique_graphs``), from a clean cache."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()


@pytest.fixture
def aot_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.compile`` with the ``aot_eager`` backend: dynamo and AOTAutograd trace as with the default backend,
    without inductor's code generation (minutes on 2 cores)."""
    import functools

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
