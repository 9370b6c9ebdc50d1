"""The model's tokenizer and the data shards of a run, as both sides see them."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from splitfed.config import RunConfig
from splitfed.data import (
    ByteTokenizer,
    Splits,
    hub_partition,
    make_partitioner,
    mnist,
    partition,
    text_windows,
)
from splitfed.models.catalog import NAMED


def tokenizer_for(cfg: RunConfig) -> Any:
    """The tokenizer of a language model run (bytes for tiny-gpt2)."""
    if cfg.model == "tiny-gpt2":
        return ByteTokenizer()
    from splitfed.models.llm import load_tokenizer

    return load_tokenizer(cfg.model)


def data_kind(cfg: RunConfig) -> str:
    """``image`` for the CNN, ``text`` for language models, ``text-classification`` for encoders."""
    info = NAMED.get(cfg.model)
    if info is not None:
        return "image" if info.data == "mnist" else "text"
    from splitfed.models.llm import load_config, task_of_config

    return "text-classification" if task_of_config(load_config(cfg.model)) == "classification" else "text"


def load_splits(cfg: RunConfig, partition_id: int, num_partitions: int) -> Splits:
    """This client's training shard and its IID share of the held-out evaluation split."""
    kind = data_kind(cfg)
    partitioner = make_partitioner(cfg.partitioner, num_partitions, alpha=cfg.dirichlet_alpha,
                                   classes_per_partition=cfg.classes_per_partition, seed=cfg.seed)
    if cfg.dataset:
        train_ds, test_ds = hub_partition(cfg.dataset, partitioner, partition_id)
        return Splits(train_ds, test_ds, kind)
    data = mnist() if kind == "image" else _text_data(cfg.model, cfg.max_seq_len)
    test = partition(data["test"], make_partitioner("iid", num_partitions), partition_id)
    return Splits(partition(data["train"], partitioner, partition_id), test, kind)


@lru_cache(maxsize=4)
def _text_data(model: str, seq_len: int) -> Any:
    """pydoc windows tokenized for ``model`` (cached: clients of one process share it)."""
    cfg = RunConfig(model=model, max_seq_len=seq_len)
    tok = tokenizer_for(cfg)
    if isinstance(tok, ByteTokenizer):
        return text_windows(tok.encode, seq_len, tok.eos_token_id)
    eos = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
    return text_windows(lambda text: tok.encode(text, add_special_tokens=False), seq_len, eos)
