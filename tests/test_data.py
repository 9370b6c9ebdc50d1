"""Embedded data, flwr-datasets partitioners (IID and non-IID), batches, and the byte tokenizer."""

from __future__ import annotations

import numpy as np
import pytest

from splitfed.data import ByteTokenizer, batches, make_partitioner, mnist, partition, pydoc_topics, text_windows
from splitfed.errors import ConfigError


def _labels(ds) -> np.ndarray:
    return np.asarray(ds["label"])


def test_mnist_is_real_and_split_stratified() -> None:
    data = mnist()
    assert len(data["train"]) == 4000 and len(data["test"]) == 1000
    assert np.bincount(_labels(data["test"]), minlength=10).tolist() == [100] * 10
    image = np.asarray(data["train"][0]["image"])
    assert image.shape == (784,) and 0.0 <= image.min() and image.max() <= 1.0 and image.max() > 0.5


def test_iid_shards_cover_the_data_once() -> None:
    train = mnist()["train"]
    parts = [partition(train, make_partitioner("iid", 4), i) for i in range(4)]
    assert sum(len(p) for p in parts) == len(train)
    for p in parts:  # every class in every shard
        assert (np.bincount(_labels(p), minlength=10) > 0).all()


def test_dirichlet_shards_are_skewed() -> None:
    train = mnist()["train"]
    parts = [partition(train, make_partitioner("dirichlet", 4, alpha=0.1, seed=1), i) for i in range(4)]
    assert sum(len(p) for p in parts) == len(train)
    dominant = [np.bincount(_labels(p), minlength=10).max() / max(len(p), 1) for p in parts if len(p)]
    assert np.mean(dominant) > 0.3  # IID would give about 0.1


def test_pathological_shards_hold_k_classes() -> None:
    train = mnist()["train"]
    for i in range(5):
        p = partition(train, make_partitioner("pathological", 5, classes_per_partition=2, seed=3), i)
        assert len(set(_labels(p).tolist())) <= 2


def test_bad_partition_settings() -> None:
    with pytest.raises(ConfigError, match="partitioner"):
        make_partitioner("random", 4)
    with pytest.raises(ConfigError, match="partition-id"):
        partition(mnist()["train"], make_partitioner("iid", 2), 5)


def test_text_windows_from_pydoc_topics_partition_by_topic() -> None:
    tok = ByteTokenizer()
    data = text_windows(tok.encode, 64, tok.eos_token_id)
    assert len(pydoc_topics()) > 50 and len(data["train"]) > 5000 and len(data["test"]) > 500
    assert all(len(w) == 64 for w in data["train"][:50]["input_ids"])
    shards = [partition(data["train"], make_partitioner("pathological", 4, classes_per_partition=1), i)
              for i in range(4)]
    topics = [set(s["topic"]) for s in shards]
    assert all(len(t) >= 1 for t in topics) and not (topics[0] & topics[1])


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "def f(x):\n    return x ** 2  # é"
    assert tok.decode(tok.encode(text) + [tok.eos_token_id]) == text


def test_batches_cycle_and_shapes() -> None:
    train = mnist()["train"].select(range(70))
    it = batches(train, 32, "image", seed=0)
    sizes = [len(next(it)) for _ in range(4)]
    assert sizes == [32, 32, 6, 32]
    b = next(batches(train, 8, "image"))
    assert b.inputs.shape == (8, 1, 28, 28) and b.labels.dtype.is_floating_point is False
    with pytest.raises(ConfigError, match="empty"):
        next(batches(train.select([]), 8, "image"))
