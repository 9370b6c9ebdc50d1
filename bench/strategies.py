"""Every Flower strategy and DP wrapper on the main job: ``python -m bench.strategies [--out outputs]``.

Runs the main job (MNIST CNN, 4 IID SuperNodes, pyproject's settings, seed 42) with ``flwr run . local`` once per
strategy that the run config's ``strategy`` key accepts (:data:`strategies.factory.STRATEGIES`) and once per
``dp-wrapper`` (:data:`strategies.factory.DP_WRAPPERS`, around FedAvg), ``--rounds`` rounds each (default 3), and
prints a Markdown table: the run-config line that picks each one and its held-out accuracy and loss after the
last round. Writes ``strategies.md`` (the table) and ``strategies.json`` (every run's per-round curves) in
``--out``.

Strategies that need arguments to mean something on 4 clients get them (:data:`ARGS`), shown in the table. A
run that does not complete fails the command (exit 1), unless :data:`LIMITATIONS` documents why it cannot run
here; the table then shows that reason. All runs share one private ``FLWR_HOME``, and the processes they leave
(the local SuperLink, Ray) are ended by PID at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: strategy name -> ``strategy-args`` that make it meaningful on 4 clients (empty: Flower's and the run config's
#: defaults). Every name of ``strategies.factory.STRATEGIES`` must be here: a new one is not skipped silently.
ARGS: dict[str, str] = {
    "fedavg": "",
    "fedprox": "proximal-mu=0.01",
    "fedadam": "eta=0.01 tau=0.001",
    "fedavgm": "server-momentum=0.9",
    "fedadagrad": "eta=0.01 tau=0.001",
    "fedyogi": "eta=0.01 tau=0.001",
    "fedmedian": "",
    "fedtrimmedavg": "beta=0.25",  # trims 1 of 4 at each end (Flower's default 0.2 trims int(0.8) = 0: FedAvg)
    "krum": "num-malicious-nodes=1",  # the one client closest to its 4 - 1 - 2 = 1 nearest neighbour
    "multikrum": "num-malicious-nodes=1 num-nodes-to-select=2",
    "bulyan": "num-malicious-nodes=0",  # Bulyan needs 4f + 3 clients: f = 1 would need 7
    "qfedavg": "q=0.1",
}
#: ``dp-wrapper`` -> ``dp-args`` (around FedAvg). Noise small enough to train on 4 clients: the noise's standard
#: deviation is noise-multiplier x clipping-norm / num-sampled-clients per parameter (about 400k here).
DP_ARGS: dict[str, str] = {
    "server-fixed": "noise-multiplier=0.001 clipping-norm=1.0 num-sampled-clients=4",
    "server-adaptive": "noise-multiplier=0.001 num-sampled-clients=4 initial-clipping-norm=1.0",
    "client-fixed": "noise-multiplier=0.001 clipping-norm=1.0 num-sampled-clients=4",
    "client-adaptive": "noise-multiplier=0.001 num-sampled-clients=4 initial-clipping-norm=1.0",
}
#: Strategies of the examples, run only when ``--only`` names them: label -> (the ServerApp, ``module:app``, that
#: replaces the project's in a copy of the project; run-config overrides). Compare with ``fedavg``: same job and seed.
EXAMPLES: dict[str, tuple[str, str]] = {
    "lr-decay": ("examples.lr_decay:app", ""),  # FedAvg with lr x 0.5 every round (examples/lr_decay.py)
}
#: label -> why that run cannot complete here (the table shows the reason, and its failure does not fail the bench).
LIMITATIONS: dict[str, str] = {}
#: What every run adds (the table's lines leave it out: it is the same for all).
COMMON = "seed=42"


@dataclass
class Run:
    """One strategy's run: its label, run-config line and per-round curves."""

    label: str
    overrides: str
    status: str = "?"
    accuracy: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)  # the clients' lr per round (``train-lr``: what they trained with)
    seconds: float = 0.0
    error: str = ""
    serverapp: str = ""  # an example's ServerApp (``module:app``) in place of the project's

    @property
    def command(self) -> str:
        """The ``flwr run`` line that picks it."""
        return f'flwr run . --run-config "{self.overrides}"'

    @property
    def limitation(self) -> str:
        """Why this run cannot complete here ("" when it should)."""
        return LIMITATIONS.get(self.label, "")

    @property
    def ok(self) -> bool:
        """It completed, or it is a documented limitation."""
        return self.status == "completed" or bool(self.limitation)


def runs_to_do(only: list[str] | None = None) -> list[Run]:
    """One :class:`Run` per strategy and DP wrapper (``only``: these labels), in the table's order.

    Raises:
        ValueError: a strategy or wrapper the factory accepts has no entry in :data:`ARGS` / :data:`DP_ARGS`, or
            ``only`` names one that does not exist.
    """
    from strategies.factory import DP_WRAPPERS, STRATEGIES

    missing = sorted(set(STRATEGIES) - set(ARGS)) + sorted(set(DP_WRAPPERS) - set(DP_ARGS))
    if missing:
        raise ValueError(f"no bench settings for {', '.join(missing)}: add them to bench.strategies.ARGS / DP_ARGS")
    runs = []
    for name in STRATEGIES:
        args = f" strategy-args='{ARGS[name]}'" if ARGS[name] else ""
        runs.append(Run(name, f"strategy='{name}'{args}"))
    for name in DP_WRAPPERS:
        runs.append(Run(f"fedavg + {name}", f"dp-wrapper='{name}' dp-args='{DP_ARGS[name]}'"))
    if only:
        runs += [Run(label, overrides, serverapp=app) for label, (app, overrides) in EXAMPLES.items()]
        unknown = set(only) - {r.label for r in runs}
        if unknown:
            valid = ", ".join(r.label for r in runs)
            raise ValueError(f"unknown label(s) {', '.join(sorted(unknown))}; valid: {valid}")
        runs = [r for r in runs if r.label in only]
    return runs


def fill(run: Run, history: dict[str, Any], seconds: float) -> Run:
    """``run`` with the status, per-round held-out accuracy and loss, and the clients' lr, of its ``history``."""
    run.status = str(history.get("status", "?"))
    run.seconds = seconds
    run.error = str(history.get("error", ""))[-2000:]
    for record in sorted(history.get("rounds", []), key=lambda r: r["round"]):
        evaluate = record.get("evaluate", {})
        run.accuracy.append(float(evaluate.get("eval-accuracy", math.nan)))
        run.loss.append(float(evaluate.get("eval-loss", math.nan)))
        run.lr.append(float(record.get("train", {}).get("train-lr", math.nan)))
    return run


def table(runs: list[Run], rounds: int) -> str:
    """The Markdown table: each strategy's run-config line, its accuracy and loss after the last round, seconds."""
    lines = [f"| strategy | run config (`flwr run . --run-config \"...\"`) | accuracy after {rounds} rounds | "
             f"loss | s |", "|---|---|---|---|---|"]
    for run in runs:
        if run.status == "completed" and run.accuracy:
            acc, loss = f"{run.accuracy[-1]:.3f}", f"{run.loss[-1]:.3f}"
        elif run.limitation:
            acc, loss = f"not run here: {run.limitation}", ""
        else:
            acc, loss = f"FAILED ({run.status})", ""
        config = f"`{run.overrides}`" if run.overrides else "(the run config's defaults)"
        if run.serverapp:
            config += f" with the ServerApp `{run.serverapp}`"
        lines.append(f"| {run.label} | {config} | {acc} | {loss} | {run.seconds:.0f} |")
    return "\n".join(lines)


def machine() -> str:
    """The machine, in words."""
    import flwr
    import torch

    return (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"torch {torch.__version__}, flwr {flwr.__version__}")


def project_with(serverapp: str, where: Path) -> Path:
    """A copy of the project (its packages and pyproject) in ``where`` whose ServerApp is ``serverapp``, with
    ``examples/*.py`` in the FAB: what docs/research.md tells a user to change."""
    import shutil

    from bench.flower import ROOT

    for name in ("splitfed", "strategies", "apps", "examples"):
        shutil.copytree(ROOT / name, where / name, ignore=shutil.ignore_patterns("__pycache__"))
    text = (ROOT / "pyproject.toml").read_text()
    old = 'serverapp = "apps.server_app:app"'
    if old not in text or '"apps/*.py"]' not in text:
        raise RuntimeError("pyproject.toml no longer names the ServerApp as bench.strategies expects")
    text = text.replace(old, f'serverapp = "{serverapp}"').replace('"apps/*.py"]', '"apps/*.py", "examples/*.py"]')
    (where / "pyproject.toml").write_text(text)
    return where


def run_all(runs: list[Run], rounds: int, work: Path, log: Any = sys.stdout) -> list[Run]:
    """Run each of ``runs`` (``rounds`` rounds) with ``flwr run . local`` in one private FLWR_HOME under ``work``."""
    from bench.flower import FlowerRuns

    with FlowerRuns(work / "flwr-home") as flower:
        for i, run in enumerate(runs):
            started = time.monotonic()
            app = project_with(run.serverapp, work / f"project{i}") if run.serverapp else "."
            history = flower.run(f"{run.overrides} num-server-rounds={rounds} {COMMON}".strip(), work / f"run{i}",
                                 app=app)
            fill(run, history, time.monotonic() - started)
            acc = " ".join(f"{a:.3f}" for a in run.accuracy)
            log.write(f"{run.label:<26} {run.status:<10} accuracy {acc}  ({run.seconds:.0f}s)\n")
            if run.status != "completed":
                log.write(f"{run.label}: {run.error}\n")
            log.flush()
    return runs


def strategies_suite(rounds: int = 3, only: tuple[str, ...] = ()) -> dict[str, float]:
    """``python -m bench --only strategies``: the held-out accuracy of each strategy after ``rounds`` rounds.

    Raises:
        BenchError: a run failed that is not a documented limitation.
    """
    from bench.processes import BenchError

    with tempfile.TemporaryDirectory(prefix="splitfed-strategies-") as tmp:
        runs = run_all(runs_to_do(list(only) or None), rounds, Path(tmp), log=sys.stderr)
    failed = [r.label for r in runs if not r.ok]
    if failed:
        raise BenchError(f"strategies that did not complete: {', '.join(failed)}")
    return {f"strategy_{r.label.replace(' + ', '_').replace('-', '_')}_accuracy": r.accuracy[-1]
            for r in runs if r.status == "completed" and r.accuracy}


def build_parser() -> argparse.ArgumentParser:
    """The command's options."""
    parser = argparse.ArgumentParser(prog="python -m bench.strategies", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs", help="folder for strategies.md and strategies.json "
                        "(default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="*", help="labels to run, e.g. fedavg krum 'fedavg + server-fixed'")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the processes started are ended
    try:
        runs = runs_to_do(args.only)
    except ValueError as exc:
        build_parser().error(str(exc))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="splitfed-strategies-") as tmp:
        run_all(runs, args.rounds, Path(tmp))
    total = time.monotonic() - started
    text = (f"{table(runs, args.rounds)}\n\n`python -m bench.strategies --rounds {args.rounds}`: {len(runs)} runs in "
            f"{total / 60:.1f} min on {machine()}; every run adds `num-server-rounds={args.rounds} {COMMON}`.")
    (out / "strategies.md").write_text(text + "\n")
    (out / "strategies.json").write_text(json.dumps({"machine": machine(), "rounds": args.rounds, "seconds": total,
                                                     "runs": [asdict(r) for r in runs]}, indent=1))
    sys.stdout.write(text + "\n")
    failed = [r.label for r in runs if not r.ok]
    if failed:
        sys.stderr.write(f"runs that did not complete: {', '.join(failed)}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
