"""bench.variants: what it reads from each run's history, its table, its plots and a partial re-run's merge."""

from __future__ import annotations

import json

import pytest

from bench import variants


def _history(accuracies: list[float]) -> dict:
    rounds = [{"round": i + 1, "seconds": 10.0 + i,
               "train": {"train-bytes-sent": 1e6, "train-bytes-received": 5e5, "train-state-bytes": 1e5},
               "evaluate": {"eval-accuracy": a, "eval-bytes-sent": 2e5, "eval-bytes-received": 1e5},
               "failures": {"train-sent": 4}} for i, a in enumerate(accuracies)]
    return {"status": "completed", "rounds": list(reversed(rounds))}  # in any order


def test_curves_table_and_merge(tmp_path) -> None:
    run = variants.curves(_history([0.5, 0.9]), "sync", "4 IID clients")
    assert run.accuracy == [0.5, 0.9] and run.seconds == [10.0, 11.0]
    assert run.bytes == [1e6 + 5e5 + 2e5 + 1e5 + 2 * 1e5 * 4] * 2  # channel both ways + parts up and down
    text = variants.table([run])
    assert "| sync | 4 IID clients | 0.900 | 2.6 | 10.5 |" in text
    path = tmp_path / "variants.json"
    path.write_text(json.dumps([{**run.row(), "curves": {"accuracy": run.accuracy, "bytes": run.bytes,
                                                         "seconds": run.seconds}}]))
    again = variants.curves(_history([0.6, 0.95]), "sync", "4 IID clients")
    other = variants.curves(_history([0.4]), "sequential (V2)", "4 IID clients")
    merged = variants._merged(path, [again, other])
    assert [(r.variant, r.accuracy[-1]) for r in merged] == [("sync", 0.95), ("sequential (V2)", 0.4)]


def test_plots_are_written(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    runs = [variants.curves(_history([0.5, 0.9]), v, p) for v in ("sync", "async")
            for p in ("4 IID clients", "4 clients, Dirichlet(0.1)")]
    variants.plot(runs, tmp_path)
    assert (tmp_path / "variants_accuracy.png").stat().st_size > 0 and (tmp_path / "variants_bytes.png").exists()
