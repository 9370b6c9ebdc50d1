"""Plots and a summary table from a run's ``history.json`` (also the ``splitfed report`` command).

``splitfed report <output-dir>`` lists the runs there and reports the latest one; ``splitfed report <run folder>``
reports that run.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PLOTS = ("loss.png", "accuracy.png", "bytes.png", "seconds.png", "epsilon.png")


def run_folder(path: str | Path) -> Path:
    """The run folder ``path`` means: itself when it holds a history (or is the file), else the run its
    ``latest`` names (an ``output-dir`` holding several runs: :mod:`splitfed.run.rundirs`)."""
    from splitfed.run.rundirs import latest_run

    p = Path(path)
    if not p.is_dir() or (p / "history.json").exists():
        return p
    return latest_run(p) or p


def load_history(path: str | Path) -> dict[str, Any]:
    """The history JSON of a run folder, of the latest run of an output folder, or the file itself."""
    p = run_folder(path)
    p = p / "history.json" if p.is_dir() else p
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no history.json at {p}; point at a run's folder or its output-dir") from None


def runs_table(output_dir: str | Path) -> str:
    """One line per run folder of ``output_dir``, oldest first: name, status, rounds, last eval accuracy
    (empty when it holds no run folders)."""
    from splitfed.run.rundirs import latest_run, list_runs

    runs, latest = list_runs(output_dir), latest_run(output_dir)
    if not runs:
        return ""
    lines = [f"runs in {output_dir} (latest: {latest.name if latest else '-'}):"]
    for run in runs:
        try:
            history = json.loads((run / "history.json").read_text())
        except (OSError, ValueError):
            lines.append(f"  {run.name}  (no history yet: running, or stopped before its first round)")
            continue
        rounds = history.get("rounds", [])
        accuracy = next((r["evaluate"]["eval-accuracy"] for r in reversed(rounds)
                         if "eval-accuracy" in r.get("evaluate", {})), None)
        lines.append(f"  {run.name}  {history.get('status', '?'):<9}  {len(rounds)} rounds"
                     + (f"  eval-accuracy {accuracy:.4f}" if accuracy is not None else ""))
    return "\n".join(lines)


def _series(rounds: list[dict[str, Any]], section: str, key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rounds:
        value = r.get(section, {}).get(key)
        if value is not None:
            xs.append(int(r["round"]))
            ys.append(float(value))
    return xs, ys


def plot(history: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write loss, accuracy, bytes, seconds (and epsilon, with DP) per round as PNGs; returns their paths."""
    from splitfed.extras import require

    matplotlib = require("matplotlib", "the PNG plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rounds = sorted(history.get("rounds", []), key=lambda r: r["round"])
    written = []

    def figure(name: str, title: str, ylabel: str, lines: list[tuple[str, list[int], list[float]]],
               logy: bool = False) -> None:
        lines = [line for line in lines if line[1]]
        if not lines:
            return
        fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
        for label, xs, ys in lines:
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_title(title)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("round")
        ax.set_ylabel(ylabel)
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name)
        plt.close(fig)
        written.append(out / name)

    figure("loss.png", "Loss per round", "loss", [("train", *_series(rounds, "train", "train-loss")),
                                                   ("evaluate", *_series(rounds, "evaluate", "eval-loss"))])
    figure("accuracy.png", "Accuracy per round", "accuracy",
           [("train", *_series(rounds, "train", "train-accuracy")),
            ("evaluate", *_series(rounds, "evaluate", "eval-accuracy"))])
    figure("bytes.png", "Bytes at the cut per round (all clients)", "bytes",
           [("client -> trunk (train)", *_series(rounds, "train", "train-bytes-sent")),
            ("trunk -> client (train)", *_series(rounds, "train", "train-bytes-received")),
            ("client -> trunk (eval)", *_series(rounds, "evaluate", "eval-bytes-sent")),
            ("trunk -> client (eval)", *_series(rounds, "evaluate", "eval-bytes-received"))], logy=True)
    xs = [int(r["round"]) for r in rounds]
    figure("seconds.png", "Seconds per round", "seconds", [("round", xs, [float(r["seconds"]) for r in rounds])])
    figure("epsilon.png", "Privacy spent (epsilon)", "epsilon",
           [("DP-SGD", *_series(rounds, "train", "train-epsilon")),
            ("cut noise", *_series(rounds, "train", "train-cut-epsilon"))])
    return written


def summary_table(history: dict[str, Any]) -> str:
    """A plain-text table: round, train loss, eval loss, eval accuracy, (eval perplexity of a language model, the
    epsilon spent with DP), bytes, seconds, failed clients.

    The perplexity and epsilon columns appear when a round recorded them (``eval-perplexity``;
    ``train-epsilon`` for DP-SGD, ``train-cut-epsilon`` for noise at the cut). ``failed`` is the clients that
    failed training / were sent training (``-`` for rounds recorded before failures were counted); a failed
    round's first error follows the table.
    """
    rounds = sorted(history.get("rounds", []), key=lambda r: r["round"])
    # Optional columns: (title, section, key, format), shown when any round has the key.
    optional = [(title, section, key, fmt) for title, section, key, fmt in _OPTIONAL
                if any(key in r.get(section, {}) for r in rounds)]
    header = f"{'round':>5}  {'train-loss':>10}  {'eval-loss':>9}  {'eval-acc':>8}" + \
        "".join(f"  {title:>{len(title)}}" for title, *_ in optional) + \
        f"  {'MB sent':>8}  {'MB recv':>8}  {'seconds':>7}  {'failed':>6}"
    lines = [header, "-" * len(header)]
    for r in rounds:
        t, e = r.get("train", {}), r.get("evaluate", {})

        def num(d: dict[str, Any], k: str, fmt: str) -> str:
            return format(d[k], fmt) if k in d else "-"

        sent = (t.get("train-bytes-sent", 0) + e.get("eval-bytes-sent", 0)) / 1e6
        recv = (t.get("train-bytes-received", 0) + e.get("eval-bytes-received", 0)) / 1e6
        extra = "".join(f"  {num(r.get(section, {}), key, fmt):>{len(title)}}" for title, section, key, fmt in optional)
        lines.append(f"{r['round']:>5}  {num(t, 'train-loss', '10.4f'):>10}  {num(e, 'eval-loss', '9.4f'):>9}  "
                     f"{num(e, 'eval-accuracy', '8.4f'):>8}{extra}  {sent:8.2f}  {recv:8.2f}  "
                     f"{r.get('seconds', 0):7.1f}  {_failed(r):>6}")
    for r in rounds:
        first = r.get("failures", {}).get("first-error")
        if first:
            lines.append(f"round {r['round']} first failure: {first}")
    if history.get("error"):
        lines.append(f"run failed: {history['error']}")
    return "\n".join(lines)


#: Columns of :func:`summary_table` shown only for runs that record them.
_OPTIONAL = (("eval-ppl", "evaluate", "eval-perplexity", "8.2f"), ("epsilon", "train", "train-epsilon", "7.3f"),
             ("cut-epsilon", "train", "train-cut-epsilon", "11.4g"))


def _failed(record: dict[str, Any]) -> str:
    failures = record.get("failures")
    if not failures:
        return "-"
    return f"{int(failures.get('train', 0))}/{int(failures.get('train-sent', 0))}"
