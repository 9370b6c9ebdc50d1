"""Compare the trunk variants on the main job: ``python -m bench.variants [--out outputs]``.

Runs the MNIST CNN job with ``flwr run . local`` once per trunk mode -- sync,
async, quorum, per-client (SplitFed V1) and sequential (SplitFed V2), plus a
heterogeneous-cut run when ``--client-cuts`` is given -- for 4 IID clients and
for 4 clients with Dirichlet(0.1) label shards, on the same data, seed and
settings (pyproject's defaults; ``--rounds`` rounds). All four ClientApps run at
once (``init-args-num-cpus=4``: sequential mode's clients wait for their
turn together), in every run. Writes:

* ``variants_accuracy.png``: held-out accuracy per round, one panel per partitioning;
* ``variants_bytes.png``: bytes per round (split channel, training and evaluation,
  plus the client parts sent and received through Flower);
* ``variants.json`` (every run's curves) and ``variants.md`` (the table: final
  accuracy, bytes per round, seconds per round).

The runs use their own ``FLWR_HOME`` and ports, and the processes they leave
(the local SuperLink, Ray) are ended by PID at the end.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.flower import FlowerRuns

#: Every run: 4 SuperNodes, and all four ClientApps at once (sequential mode's clients wait for their turn together).
FEDERATION = "client-resources-num-cpus=1 init-args-num-cpus=4"

#: label -> run-config overrides; the heterogeneous-cut run is added by ``--client-cuts``.
VARIANTS: dict[str, str] = {
    "sync": "trunk-mode='sync'",
    "async": "trunk-mode='async'",
    "quorum": "trunk-mode='quorum'",
    "per-client (V1)": "trunk-mode='per-client'",
    "sequential (V2)": "trunk-mode='sequential'",
}
PARTITIONS: dict[str, str] = {
    "4 IID clients": "partitioner='iid'",
    "4 clients, Dirichlet(0.1)": "partitioner='dirichlet' dirichlet-alpha=0.1",
}


@dataclass
class Run:
    """One run's per-round curves."""

    variant: str
    partition: str
    accuracy: list[float] = field(default_factory=list)
    bytes: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    status: str = "completed"
    trunk: dict[str, float] = field(default_factory=dict)  # the trunk's counters after the last round

    def row(self) -> dict[str, Any]:
        """The table's row: final accuracy, mean bytes and seconds per round."""
        n = max(len(self.seconds), 1)
        return {"variant": self.variant, "partition": self.partition, "status": self.status,
                "accuracy": self.accuracy[-1] if self.accuracy else float("nan"),
                "bytes-per-round": sum(self.bytes) / n, "seconds-per-round": sum(self.seconds) / n}


def round_bytes(record: dict[str, Any]) -> float:
    """Bytes of one round: the split channel (train and evaluate) and the client parts through Flower."""
    train, ev = record.get("train", {}), record.get("evaluate", {})
    channel = sum(float(d.get(f"{p}-bytes-{k}", 0.0)) for d, p in ((train, "train"), (ev, "eval"))
                  for k in ("sent", "received"))
    clients = float(record.get("failures", {}).get("train-sent", 4))
    parts = 2.0 * float(train.get("train-state-bytes", 0.0)) * clients  # each client's parts up and down
    return channel + parts


def curves(history: dict[str, Any], variant: str, partition: str) -> Run:
    """The per-round accuracy, bytes and seconds of a run's history."""
    run = Run(variant, partition, status=history.get("status", "?"))
    for record in sorted(history["rounds"], key=lambda r: r["round"]):
        run.accuracy.append(float(record["evaluate"].get("eval-accuracy", float("nan"))))
        run.bytes.append(round_bytes(record))
        run.seconds.append(float(record["seconds"]))
        run.trunk = dict(record.get("trunk", {}))
    return run


def _merged(path: Path, runs: list[Run]) -> list[Run]:
    """The runs of an earlier ``variants.json`` with these ones in place of the same variant and partitioning
    (to redo some runs of a comparison)."""
    if not path.exists():
        return runs
    new = {(r.variant, r.partition): r for r in runs}
    out = []
    for row in json.loads(path.read_text()):
        key = (row["variant"], row["partition"])
        curves_ = row["curves"]
        out.append(new.pop(key, None) or Run(key[0], key[1], curves_["accuracy"], curves_["bytes"],
                                              curves_["seconds"], row["status"], row.get("trunk", {})))
    return out + list(new.values())


def table(runs: list[Run]) -> str:
    """A Markdown table of the runs."""
    lines = ["| variant | clients | accuracy (last round) | MB / round | s / round |", "|---|---|---|---|---|"]
    for run in runs:
        r = run.row()
        acc = f"{r['accuracy']:.3f}" if r["status"] == "completed" else f"failed ({r['status']})"
        lines.append(f"| {r['variant']} | {r['partition']} | {acc} | {r['bytes-per-round'] / 1e6:.1f} | "
                     f"{r['seconds-per-round']:.1f} |")
    return "\n".join(lines)


def plot(runs: list[Run], out: Path) -> None:
    """``variants_accuracy.png`` and ``variants_bytes.png``: one panel per partitioning, a line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    partitions = list(dict.fromkeys(r.partition for r in runs))
    for what, ylabel, scale, name in (("accuracy", "held-out accuracy", 1.0, "variants_accuracy.png"),
                                      ("bytes", "MB per round", 1e-6, "variants_bytes.png")):
        fig, axes = plt.subplots(1, len(partitions), figsize=(5.5 * len(partitions), 4), dpi=100, squeeze=False)
        for ax, partition in zip(axes[0], partitions):
            for run in (r for r in runs if r.partition == partition):
                ys = [y * scale for y in getattr(run, what)]
                ax.plot(range(1, len(ys) + 1), ys, marker="o", label=run.variant)
            ax.set_title(partition)
            ax.set_xlabel("round")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle("MNIST CNN: trunk variants, same data and seed")
        fig.tight_layout()
        fig.savefig(out / name)
        plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    """The command's options."""
    parser = argparse.ArgumentParser(prog="python -m bench.variants", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs", help="folder for the plots, JSON and table (default: "
                        "%(default)s; --out docs/img replaces the committed ones)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", nargs="*", help="variant labels to run (default: all)")
    parser.add_argument("--partitions", nargs="*", choices=sorted(PARTITIONS), help="default: both")
    parser.add_argument("--client-cuts", default="", help="add a heterogeneous-cut run (sync) with this "
                        "client-cuts value, e.g. \"2,6 3,6\"")
    parser.add_argument("--extra", default="", help="run-config overrides for every run, e.g. \"local-steps=10\"")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from splitfed.config import check_keys, override_keys
    from splitfed.errors import ConfigError

    try:  # before any run: Flower would only say "[code: 15] Invalid run configuration"
        check_keys(override_keys(args.extra))
    except ConfigError as exc:
        parser.error(f"--extra: {exc}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the processes started are ended below
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = dict(VARIANTS)
    if args.client_cuts:
        variants["heterogeneous cuts"] = f"trunk-mode='sync' client-cuts='{args.client_cuts}'"
    if args.only:
        variants = {k: v for k, v in variants.items() if k in args.only}
    partitions = {k: v for k, v in PARTITIONS.items() if not args.partitions or k in args.partitions}
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="splitfed-variants-") as tmp:
        flower = FlowerRuns(Path(tmp) / "flwr-home")
        try:
            for p_label, p_over in partitions.items():
                for v_label, v_over in variants.items():
                    started = time.monotonic()
                    overrides = f"{v_over} {p_over} num-server-rounds={args.rounds} seed=42 {args.extra}".strip()
                    history = flower.run(overrides, Path(tmp) / f"run{len(runs)}", federation=FEDERATION)
                    if history.get("status") != "completed":
                        sys.stderr.write(f"{v_label}, {p_label}: {history.get('error', 'the run failed')}\n")
                    runs.append(curves(history, v_label, p_label))
                    sys.stdout.write(f"{v_label:<20} {p_label:<28} {runs[-1].status:<10} accuracy "
                                     + " ".join(f"{a:.3f}" for a in runs[-1].accuracy)
                                     + f"  ({time.monotonic() - started:.0f}s)\n")
                    sys.stdout.flush()
        finally:
            flower.close()
    failed = [f"{r.variant} ({r.partition})" for r in runs if r.status != "completed"]
    runs = _merged(out / "variants.json", runs) if (args.only or args.partitions) else runs
    (out / "variants.json").write_text(json.dumps([{**r.row(), "trunk": r.trunk, "curves": {
        "accuracy": r.accuracy, "bytes": r.bytes, "seconds": r.seconds}} for r in runs], indent=1))
    text = table(runs)
    (out / "variants.md").write_text(text + "\n")
    sys.stdout.write(text + "\n")
    try:
        plot(runs, out)
    except ImportError:
        sys.stderr.write("no plots: pip install 'splitfed[plots]' (matplotlib)\n")
    if failed:  # the table and plots show them; the comparison is incomplete
        sys.stderr.write(f"runs that did not complete: {', '.join(failed)}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
