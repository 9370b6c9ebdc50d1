"""SplitFed on MNIST beside centralized training: ``python -m bench.mnist_curves [--out outputs]``.

Runs the main job with ``flwr run . local`` twice (4 IID clients; 4 clients with
Dirichlet(0.1) label shards), trains the unsplit CNN centrally on the same 4,000
training images for the same number of gradient steps per round, and plots the
held-out accuracy of all three per round.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from bench.flower import ROOT, flwr_run

#: key -> (label, run-config overrides) of the SplitFed runs.
RUNS = {"iid": ("SplitFed, 4 IID clients", "partitioner='iid'"),
        "dirichlet": ("SplitFed, 4 clients, Dirichlet(0.1)", "partitioner='dirichlet' dirichlet-alpha=0.1")}


def centralized(rounds: int, steps_per_round: int, batch_size: int, lr: float, momentum: float,
                seed: int = 42) -> list[float]:
    """Held-out accuracy per round of the unsplit CNN trained on all training images."""
    from splitfed.data import batches, mnist
    from splitfed.models.catalog import build_model

    data = mnist()
    model = build_model("mnist-cnn", seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    it = batches(data["train"], batch_size, "image", seed=seed)
    out = []
    for _ in range(rounds):
        model.train()
        for _ in range(steps_per_round):
            b = next(it)
            loss = torch.nn.functional.cross_entropy(model(b.inputs), b.labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for b in batches(data["test"], 256, "image", shuffle=False, epochs=1):
                correct += int((model(b.inputs).argmax(-1) == b.labels).sum())
                total += len(b)
        out.append(correct / total)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command's options."""
    parser = argparse.ArgumentParser(prog="python -m bench.mnist_curves", description=__doc__)
    parser.add_argument("--out", default="outputs", help="folder for mnist_curves.png/.json (default: %(default)s; "
                        "--out docs/img replaces the README's figure)")
    parser.add_argument("--only", nargs="*", choices=sorted(RUNS), help="SplitFed runs to make (default: both)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds (default: pyproject's num-server-rounds)")
    parser.add_argument("--local-steps", type=int, default=0, help="steps per round (default: pyproject's)")
    return parser


def main() -> int:
    args = build_parser().parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    rounds = args.rounds or cfg["num-server-rounds"]
    steps = args.local_steps or cfg["local-steps"]
    batch = cfg["batch-size"]
    with tempfile.TemporaryDirectory() as tmp:
        runs = {label: flwr_run(f"{overrides} num-server-rounds={rounds} local-steps={steps}", Path(tmp) / key)
                for key, (label, overrides) in RUNS.items() if not args.only or key in args.only}
    curves = {name: [r["evaluate"].get("eval-accuracy") for r in sorted(h["rounds"], key=lambda r: r["round"])]
              for name, h in runs.items()}
    curves["centralized (unsplit, same steps)"] = centralized(rounds, 4 * steps, batch, cfg["lr"], cfg["momentum"])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6.5, 4), dpi=100)
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=name)
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("held-out accuracy (1,000 images)")
    ax.set_title("MNIST CNN: SplitFed vs centralized")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "mnist_curves.png")
    (out / "mnist_curves.json").write_text(json.dumps(curves, indent=1))
    for name, ys in curves.items():
        sys.stdout.write(f"{name:<40} " + " ".join(f"{y:.3f}" for y in ys) + "\n")
    sys.stdout.write(f"written: {out / 'mnist_curves.png'}, {out / 'mnist_curves.json'}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
