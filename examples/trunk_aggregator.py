"""A custom trunk aggregator: sync steps on the coordinate-wise median of the clients' gradients.

``python examples/trunk_aggregator.py`` trains a small CNN's trunk with three
clients, one of which sends gradients 100 times too large, once with the
built-in sync rule (the example-weighted mean) and once with this one, and
prints how far each step moved the trunk.

An aggregator decides *when* the trunk steps (:meth:`ready`) and *with what*
(:meth:`combine`); the mechanism around it (futures, timeouts, staleness,
all-or-nothing steps) is the base class's. To serve it in a Flower run, give it
to the server side: ``ServerRunner(cfg, aggregator=MedianSync(timeout=...))`` in
your ServerApp (see ``apps/server_app.py`` and ``docs/research.md``).
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from splitfed.models.catalog import mnist_cnn  # noqa: E402
from splitfed.split import CutState, split_model  # noqa: E402
from splitfed.trunk.aggregation.modes import Contribution, Grads, SyncAggregator  # noqa: E402
from splitfed.trunk.compute.runtime import TrunkRuntime  # noqa: E402


class MedianSync(SyncAggregator):
    """Wait for every member's gradient (as sync does), then step on their coordinate-wise median."""

    mode = "median-sync"

    def combine(self, contributions: Sequence[Contribution]) -> Grads | None:
        live = [c.grads for c in contributions if c.grads is not None]
        if not live:
            return None
        out: Grads = []
        for i in range(len(live[0])):
            parts = [g[i] for g in live if g[i] is not None]
            out.append(torch.stack(parts).median(dim=0).values if parts else None)
        return out


def one_step(aggregator: SyncAggregator, scales: Sequence[float], seed: int = 0) -> float:
    """One trunk step of ``len(scales)`` clients whose gradients are scaled by ``scales``; returns how far
    (L2) the trunk's weights moved."""
    torch.manual_seed(seed)
    trunk = split_model(mnist_cnn(width=4), (3, 6)).trunk
    before = [p.detach().clone() for p in trunk.parameters()]
    runtime = TrunkRuntime(trunk, torch.optim.SGD(trunk.parameters(), lr=0.1), aggregator=aggregator)
    pending = []
    for i, scale in enumerate(scales):
        client = f"client-{i}"
        runtime.join(client)
        hidden = torch.randn(8, 4, 14, 14)
        act = uuid.uuid4().hex
        out, _ = runtime.forward(client, act, CutState(hidden), train=True, num_examples=8)
        pending.append((client, act, torch.randn_like(out) * 0.01 * scale))
    results = [runtime.start_backward(client, act, grad).result for client, act, grad in pending]
    assert all(r.done() for r in results) and runtime.version == 1  # the last gradient completed the step
    return float(sum(((p.detach() - b) ** 2).sum() for p, b in zip(trunk.parameters(), before)) ** 0.5)


def main() -> dict[str, float]:
    """Compare the mean and the median with one outlier among three clients."""
    scales = [1.0, 1.0, 100.0]
    moved = {"sync (mean)": one_step(SyncAggregator(), scales), "median-sync": one_step(MedianSync(), scales),
             "median-sync, no outlier": one_step(MedianSync(), [1.0, 1.0, 1.0])}
    for name, value in moved.items():
        sys.stdout.write(f"{name:<26} trunk moved by {value:.4f}\n")
    return moved


if __name__ == "__main__":
    main()
