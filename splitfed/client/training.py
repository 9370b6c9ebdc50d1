"""Client-side training and evaluation of the bottom and top parts with a (remote) trunk.

Plain torch: the loop is ``loss.backward(); optimizer.step()``; the remote
trunk's forward and backward travel inside autograd (see
:class:`~splitfed.channel.client.remote.RemoteTrunk`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from splitfed.data import Batch
from splitfed.errors import TensorValueError
from splitfed.split.base import SplitModel

log = logging.getLogger(__name__)


@dataclass
class Report:
    """What one round of local training or evaluation measured."""

    loss: float = 0.0
    accuracy: float = 0.0
    num_examples: int = 0
    steps: int = 0
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_shared: int = 0  # of those sent and received, the bytes that crossed through shared memory
    outcomes: dict[str, int] = field(default_factory=dict)
    trunk_version: int = 0

    def metrics(self, prefix: str = "", training: bool = True) -> dict[str, float | int]:
        """Flat metrics for Flower's MetricRecord (kebab-case keys); trunk outcomes only for training."""
        out: dict[str, float | int] = {
            f"{prefix}loss": self.loss, f"{prefix}accuracy": self.accuracy, "num-examples": self.num_examples,
            f"{prefix}seconds": self.seconds, f"{prefix}bytes-sent": self.bytes_sent,
            f"{prefix}bytes-received": self.bytes_received, f"{prefix}bytes-shared": self.bytes_shared,
        }
        if training:
            out[f"{prefix}steps"] = self.steps
            out[f"{prefix}step-seconds"] = self.seconds / self.steps if self.steps else 0.0
            out[f"{prefix}trunk-version"] = self.trunk_version
            for name in ("APPLIED", "DOWNWEIGHTED", "REJECTED_STALE", "REJECTED_GUARD"):
                out[f"{prefix}trunk-{name.lower().replace('_', '-')}"] = self.outcomes.get(name, 0)
        return out


def _correct(logits: torch.Tensor, labels: torch.Tensor, task: str) -> tuple[int, int]:
    """(correct, counted): class accuracy, or next-token accuracy over non-ignored labels."""
    if task == "causal-lm":
        pred = logits[:, :-1].argmax(-1)
        target = labels[:, 1:]
        valid = target != -100
        return int((pred[valid] == target[valid]).sum()), int(valid.sum())
    if logits.shape[-1] == 1:
        return 0, 0
    return int((logits.argmax(-1) == labels).sum()), int(labels.numel())


def _progress(total: int, desc: str) -> Any:
    """A tqdm bar when a terminal is attached, else a no-op."""
    if not sys.stderr.isatty():
        return contextlib.nullcontext()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, leave=False, unit="step")


def _channel_counters(trunk: torch.nn.Module) -> tuple[int, int, int]:
    client = getattr(trunk, "client", None)
    if client is None:
        return 0, 0, 0
    shared = getattr(client, "shared", None)
    return client.bytes_sent, client.bytes_received, 0 if shared is None else shared.bytes


def train(model: SplitModel, optimizer: torch.optim.Optimizer, data: Iterable[Batch], steps: int, *,
          autocast_dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
          before_step: Any = None, progress: str | None = None) -> Report:
    """Run ``steps`` optimizer steps of bottom + (remote) trunk + top on ``data``.

    The remote trunk (if any) joins the trunk's step group for the duration, so
    sync and quorum modes count this client while it trains. ``before_step`` is
    called after ``backward`` and before ``optimizer.step`` (DP noise, clipping).
    """
    model.train()
    trunk = model.trunk
    sent0, received0, shared0 = _channel_counters(trunk)
    join = getattr(getattr(trunk, "client", None), "join", None)
    report = Report()
    loss_sum = correct = counted = 0.0
    start = time.perf_counter()
    it: Iterator[Batch] = iter(data)
    if join is not None:
        join()
    bar = _progress(steps, progress) if progress else contextlib.nullcontext()
    try:
        with bar as pbar:
            for step in range(steps):
                batch = next(it, None)
                if batch is None:
                    break
                inputs = batch.inputs.to(device)
                mask = None if batch.attention_mask is None else batch.attention_mask.to(device)
                labels = batch.labels.to(device)
                ctx = torch.autocast(torch.device(device).type, dtype=autocast_dtype) if autocast_dtype \
                    else contextlib.nullcontext()
                with ctx:
                    out = model(inputs, attention_mask=mask, labels=labels)
                if not torch.isfinite(out.loss):
                    raise TensorValueError(f"loss is {out.loss.item()} at local step {step}; lower lr (or check "
                                           "that the trunk server returns finite activations)")
                optimizer.zero_grad(set_to_none=True)
                out.loss.backward()
                if before_step is not None:
                    before_step()
                optimizer.step()
                n = len(batch)
                loss_sum += out.loss.item() * n
                report.num_examples += n
                report.steps += 1
                c, k = _correct(out.logits.detach(), labels, model.task)
                correct, counted = correct + c, counted + k
                log.debug("step %d loss %.4f", step, out.loss.item())
                if pbar is not None:
                    pbar.update(1)
                    pbar.set_postfix(loss=f"{out.loss.item():.3f}")
    finally:
        if join is not None:
            with contextlib.suppress(Exception):
                trunk.client.leave()
    report.seconds = time.perf_counter() - start
    report.loss = loss_sum / max(report.num_examples, 1)
    report.accuracy = correct / counted if counted else 0.0
    sent1, received1, shared1 = _channel_counters(trunk)
    report.bytes_sent, report.bytes_received = sent1 - sent0, received1 - received0
    report.bytes_shared = shared1 - shared0
    report.outcomes = dict(getattr(trunk, "outcomes", {}))
    report.trunk_version = int(getattr(trunk, "last_version", 0))
    return report


@torch.no_grad()
def evaluate(model: SplitModel, data: Iterable[Batch], *, max_batches: int = 0,
             device: torch.device | str = "cpu") -> Report:
    """Forward-only evaluation (the trunk saves nothing); loss, accuracy (or next-token accuracy)."""
    model.eval()
    sent0, received0, shared0 = _channel_counters(model.trunk)
    report = Report()
    loss_sum = correct = counted = 0.0
    start = time.perf_counter()
    for i, batch in enumerate(data):
        if max_batches and i >= max_batches:
            break
        labels = batch.labels.to(device)
        out = model(batch.inputs.to(device), attention_mask=None if batch.attention_mask is None else
                    batch.attention_mask.to(device), labels=labels)
        n = len(batch)
        loss_sum += float(out.loss) * n
        report.num_examples += n
        c, k = _correct(out.logits, labels, model.task)
        correct, counted = correct + c, counted + k
    report.seconds = time.perf_counter() - start
    report.loss = loss_sum / max(report.num_examples, 1)
    report.accuracy = correct / counted if counted else 0.0
    sent1, received1, shared1 = _channel_counters(model.trunk)
    report.bytes_sent, report.bytes_received = sent1 - sent0, received1 - received0
    report.bytes_shared = shared1 - shared0
    return report


def perplexity(loss: float) -> float:
    """exp(loss), capped to stay finite in JSON."""
    return math.exp(min(loss, 50.0))
