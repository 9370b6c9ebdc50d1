"""Aggregation of SplitFed's client metrics: means where a mean means something, sums for counts."""

from __future__ import annotations

from flwr.app import MetricRecord, RecordDict

#: Metric-name endings that add up across clients (bytes, steps, trunk outcomes).
SUMMED = ("bytes-sent", "bytes-received", "bytes-shared", "steps", "trunk-applied", "trunk-downweighted",
          "trunk-rejected-stale", "trunk-rejected-guard")
#: Metric-name endings where the slowest or latest client counts.
MAXED = ("seconds", "trunk-version", "epsilon")


def aggregate_split_metrics(records: list[RecordDict], weighted_by_key: str) -> MetricRecord:
    """Weighted mean by ``weighted_by_key`` for losses and accuracies; sums and maxima as listed above.

    The total of ``weighted_by_key`` is kept too (FedAvg's default drops it).
    """
    rows = [next(iter(r.metric_records.values())) for r in records]
    total = float(sum(float(row[weighted_by_key]) for row in rows)) or 1.0
    out: dict[str, float] = {weighted_by_key: total}
    keys = sorted({k for row in rows for k in row.keys()} - {weighted_by_key})
    for key in keys:
        values = [(float(row[key]), float(row[weighted_by_key])) for row in rows if key in row
                  and not isinstance(row[key], list)]
        if not values:
            continue
        if key.endswith(SUMMED):
            out[key] = sum(v for v, _ in values)
        elif key.endswith(MAXED):
            out[key] = max(v for v, _ in values)
        else:
            weight = sum(w for _, w in values) or 1.0
            out[key] = sum(v * w for v, w in values) / weight
    return MetricRecord(out)


#: Client metrics that go to history.json (and the DEBUG log) but not into the record Flower logs and returns
#: each round: the trunk's counters and the run's bookkeeping. What stays is what a user reads (loss, accuracy,
#: perplexity, examples, seconds, bytes, privacy spent, failures) and any key of a researcher's own.
DETAILS = frozenset({
    "train-steps", "train-step-seconds", "train-trunk-version", "train-trunk-applied", "train-trunk-downweighted",
    "train-trunk-rejected-stale", "train-trunk-rejected-guard", "train-state-bytes", "train-lr",
    "train-dp-noise-multiplier", "train_loss",  # train_loss: the copy of train-loss that Flower's QFedAvg reads
})
#: Counters shown only when they count something.
WHEN_NONZERO = ("bytes-shared", "failures")


def user_facing(metrics: MetricRecord | None) -> MetricRecord | None:
    """``metrics`` without :data:`DETAILS`, and without :data:`WHEN_NONZERO` counters that are zero."""
    if metrics is None:
        return None
    return MetricRecord({k: v for k, v in metrics.items() if k not in DETAILS
                         and not (k.endswith(WHEN_NONZERO) and not isinstance(v, list) and float(v) == 0.0)})
