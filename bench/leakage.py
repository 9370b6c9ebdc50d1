"""Leakage score: what an honest-but-curious trunk server recovers from what it sees, per privacy setting.

``python -m bench.leakage [--quick] [--json] [--only mnist lm]`` trains each setting briefly through the real
split channel on loopback (client loop, ``ClientPrivacy``, trunk server), then attacks what the server saw:

* **inputs from cut activations**: the server holds the bottom's weights (it aggregates them) and knows the
  defence, so it trains an inversion decoder on *public* data (activations -> inputs, the same noise applied)
  and runs it on the activations of the client's *private* data. MNIST: reconstruction MSE and SSIM (higher
  SSIM: better reconstruction). Tiny GPT-2: accuracy of token ids recovered from the cut hidden states.
* **labels from the gradients the client sends back** (Li et al., "Label Leakage and Protection in Two-party
  Split Learning"): norm attack (AUC of ``||g||`` for "label = c", one-vs-rest, mean over labels with at least
  10 examples) and direction attack (AUC of ``cos(g_i, g_j)`` for "same label"; and the accuracy of labelling
  every example like the most similar of the examples whose label the server knows, one per label: 1-shot).

``python -m bench.leakage --federated`` instead runs the main job with ``flwr run . local`` (4 clients) with
DP-SGD (``dp-target-epsilon=8``, ``dp-delta=1e-5``) beside the same run without privacy, and prints accuracy
and epsilon per round.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.attacks import invert_images, invert_tokens, label_attacks
from splitfed.data import ByteTokenizer, collate, mnist, text_windows
from splitfed.privacy import ClientPrivacy, PrivacyConfig
from splitfed.split import SplitModel, split_model

log = logging.getLogger("bench.leakage")
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Setting:
    """A privacy configuration of the table."""

    name: str
    privacy: PrivacyConfig
    lr: float = 0.05
    optimizer: str = "sgd"  # sgd (momentum 0.9) or adam, on the client parts and the trunk


@dataclass(frozen=True)
class Task:
    """A model, its data and the training budget of one harness run."""

    name: str
    steps: int
    batch_size: int
    attack_steps: int
    settings: tuple[Setting, ...]
    extra: dict[str, Any] = field(default_factory=dict)


# -- settings ------------------------------------------------------------------------------------------
def _settings(act_clip: float, act: tuple[float, float], grad_clip: float, grad: float, lr: float,
              dp_lr: float, optimizer: str = "sgd") -> tuple[Setting, ...]:
    """No defence; activation noise at two levels; gradient (label) noise; DP-SGD at epsilon 8; all three."""
    return tuple(replace(s, optimizer=optimizer) for s in (
        Setting("none", PrivacyConfig(), lr),
        Setting(f"act-noise {act[0]}", PrivacyConfig(cut_noise_clip=act_clip, cut_noise_sigma=act[0]), lr),
        Setting(f"act-noise {act[1]}", PrivacyConfig(cut_noise_clip=act_clip, cut_noise_sigma=act[1]), lr),
        Setting(f"grad-noise {grad}", PrivacyConfig(cut_grad_clip=grad_clip, cut_grad_sigma=grad), lr),
        Setting("dp-sgd eps 8", PrivacyConfig(dp_target_epsilon=8.0, dp_max_grad_norm=1.0), dp_lr),
        Setting("all three", PrivacyConfig(dp_target_epsilon=8.0, cut_noise_clip=act_clip, cut_noise_sigma=act[1],
                                           cut_grad_clip=grad_clip, cut_grad_sigma=grad), dp_lr),
    ))


def mnist_task(quick: bool) -> Task:
    """MNIST CNN cut at (3, 6): 2,000 private training images, 2,000 public ones for the attacker.

    Activations are clipped to 10 (their norms are 12-16 at initialisation), the gradients the client
    returns to 0.5 (per example's own loss; about 0.23 at initialisation).
    """
    return Task("mnist-cnn", 80 if quick else 200, 64, 120 if quick else 300,
                _settings(act_clip=10.0, act=(0.02, 0.05), grad_clip=0.5, grad=0.05, lr=0.05, dp_lr=0.1))


def lm_task(quick: bool) -> Task:
    """Tiny GPT-2 (4 blocks, hidden 128) cut at (1, 3) on byte-level pydoc windows of 64 tokens.

    Activations (64 x 128 per example) are clipped to 30: their norm is 3 at initialisation but about 35
    after 20 steps (the embeddings grow). Returned gradients are clipped to 0.5 (about 0.63 at
    initialisation). Noise on all 8,192 coordinates of an example costs this model far more than the CNN:
    gradient noise of 0.02 and above diverges with SGD here, so the levels are lower.
    """
    return Task("tiny-gpt2", 40 if quick else 120, 16, 100 if quick else 300,
                _settings(act_clip=30.0, act=(0.001, 0.005), grad_clip=0.5, grad=0.01, lr=0.05, dp_lr=0.1))


# -- training through the split channel ---------------------------------------------------------------
def _client_optimizer(model: SplitModel, setting: Setting) -> torch.optim.Optimizer:
    params = [p for p in model.client_modules().parameters() if p.requires_grad]
    if setting.optimizer == "adam":
        return torch.optim.Adam(params, lr=setting.lr)
    return torch.optim.SGD(params, lr=setting.lr, momentum=0.9)


def train_setting(parts: Any, setting: Setting, data: Any, kind: str, steps: int, batch_size: int,
                  seed: int) -> dict[str, float]:
    """Train bottom+top on ``data`` against a trunk server on loopback, with ``setting``'s privacy."""
    from splitfed.channel.client.remote import RemoteTrunk
    from splitfed.channel.server.trunkserver import TrunkServer
    from splitfed.errors import ChannelError, TensorValueError
    from splitfed.client.training import train

    server = TrunkServer(parts.trunk, insecure=True, optimizer=setting.optimizer, lr=setting.lr, momentum=0.9).start()
    trunk = RemoteTrunk(f"127.0.0.1:{server.port}", insecure=True)
    model = SplitModel(parts.bottom, trunk, parts.top, task=parts.task, config=parts.config)
    optimizer = _client_optimizer(model, setting)
    started = time.perf_counter()
    try:
        with ClientPrivacy(setting.privacy, model, optimizer, dataset_size=len(data), batch_size=batch_size,
                           steps=steps, planned_steps=steps, seed=seed) as privacy:
            try:
                report = train(model, privacy.optimizer, privacy.batches(data, kind), steps)
            except (ChannelError, TensorValueError) as exc:  # NaN/Inf activations or loss: diverged
                log.warning("%s diverged: %s", setting.name, exc)
                return {**privacy.metrics(""), "diverged": 1.0, "train-seconds": time.perf_counter() - started}
            metrics = privacy.metrics("")
    finally:
        trunk.close()
        server.stop(grace=0)
    metrics["train-loss"] = report.loss
    metrics["train-seconds"] = time.perf_counter() - started
    return metrics


@torch.no_grad()
def accuracy(model: SplitModel, data: Any, kind: str, privacy: PrivacyConfig, batch: int = 256) -> float:
    """Held-out accuracy (next-token accuracy for the LM) with the setting's evaluation noise on."""
    from splitfed.privacy import install_eval_noise
    from splitfed.client.training import evaluate

    def batches() -> Iterator[Any]:
        for start in range(0, len(data), batch):
            yield collate(data[start:start + batch], kind)

    noise = install_eval_noise(privacy, model)
    try:
        return evaluate(model, batches()).accuracy
    finally:
        if noise is not None:
            noise.remove()


# -- what the server sees ------------------------------------------------------------------------------
def observe(model: SplitModel, privacy: PrivacyConfig, rows: Any, kind: str, batch: int,
            generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The activations the trunk receives, the gradients it receives for its output, and the labels.

    Training-mode forward and backward (no optimizer step) with ``privacy``'s cut noise, in batches of
    ``batch`` as in training; returns detached tensors stacked over the examples of ``rows``.
    """
    seen: dict[str, list[torch.Tensor]] = {"act": [], "grad": []}

    def on_trunk(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        seen["act"].append(args[0].hidden.detach())
        out.hidden.register_hook(lambda g: seen["grad"].append(g.detach() * g.shape[0]))  # per-example loss

    cut = privacy.cut_noise_module(generator=generator)
    handle = model.trunk.register_forward_hook(on_trunk)
    if cut is not None:
        cut.install(model)
    labels = []
    model.train()
    try:
        n = len(rows["label"]) if kind == "image" else len(rows["input_ids"])
        for start in range(0, n, batch):
            b = collate({k: v[start:start + batch] for k, v in rows.items()}, kind)
            model.zero_grad(set_to_none=True)
            model(b.inputs, attention_mask=b.attention_mask, labels=b.labels).loss.backward()
            labels.append(b.labels)
    finally:
        handle.remove()
        if cut is not None:
            cut.remove()
        model.zero_grad(set_to_none=True)
    return torch.cat(seen["act"]), torch.cat(seen["grad"]), torch.cat(labels)


# -- the two tasks ------------------------------------------------------------------------------------------
def _first(ds: Any, start: int, stop: int) -> dict[str, Any]:
    return ds[start:stop]


def run_mnist(task: Task, seed: int = 0) -> list[dict[str, Any]]:
    """Train and attack every setting on the MNIST CNN."""
    from splitfed.models.catalog import mnist_cnn

    data = mnist()
    private, public, test = data["train"].select(range(2000)), data["train"].select(range(2000, 4000)), data["test"]
    attack_private, attack_public = _first(private, 0, 500), _first(public, 0, 1000)
    rows = []
    for setting in task.settings:
        torch.manual_seed(seed)
        parts = split_model(mnist_cnn(), (3, 6))
        metrics = train_setting(parts, setting, private, "image", task.steps, task.batch_size, seed)
        if metrics.get("diverged"):
            rows.append({"task": task.name, "setting": setting.name + " (diverged)", **metrics})
            continue
        model = SplitModel(parts.bottom, parts.trunk, parts.top, task="classification")
        acc = accuracy(model, test, "image", setting.privacy)
        g = torch.Generator().manual_seed(seed + 1)
        pub_act, _, _ = observe(model, setting.privacy, attack_public, "image", task.batch_size, g)
        priv_act, priv_grad, priv_y = observe(model, setting.privacy, attack_private, "image", task.batch_size, g)
        pub_x = collate(attack_public, "image").inputs
        priv_x = collate(attack_private, "image").inputs
        result = {"task": task.name, "setting": setting.name, "accuracy": acc, **metrics,
                  **invert_images(pub_act, pub_x, priv_act, priv_x, task.attack_steps, g),
                  **label_attacks(priv_grad, priv_y, g)}
        log.info("%s", result)
        rows.append(result)
    return rows


def run_lm(task: Task, seed: int = 0) -> list[dict[str, Any]]:
    """Train and attack every setting on tiny GPT-2 with byte tokens."""
    from transformers import GPT2LMHeadModel

    from splitfed.models.catalog import tiny_gpt2_config

    tok = ByteTokenizer()
    data = text_windows(tok.encode, 64, tok.eos_token_id)
    private, public = data["train"].select(range(2000)), data["train"].select(range(2000, 4000))
    test = data["test"].select(range(256))
    attack_private, attack_public = _first(private, 0, 200), _first(public, 0, 1000)
    rows = []
    for setting in task.settings:
        torch.manual_seed(seed)
        model_full = GPT2LMHeadModel(tiny_gpt2_config(tok.vocab_size, layers=4, hidden=128, heads=4, positions=64))
        parts = split_model(model_full, (1, 3))
        metrics = train_setting(parts, setting, private, "text", task.steps, task.batch_size, seed)
        if metrics.get("diverged"):
            rows.append({"task": task.name, "setting": setting.name + " (diverged)", **metrics})
            continue
        model = SplitModel(parts.bottom, parts.trunk, parts.top, task="causal-lm", config=parts.config)
        acc = accuracy(model, test, "text", setting.privacy, batch=64)
        g = torch.Generator().manual_seed(seed + 1)
        pub_act, _, _ = observe(model, setting.privacy, attack_public, "text", task.batch_size, g)
        priv_act, priv_grad, priv_ids = observe(model, setting.privacy, attack_private, "text", task.batch_size, g)
        # Label of position t is token t+1; the last position has none.
        next_ids = priv_ids[:, 1:].reshape(-1)
        grads = priv_grad[:, :-1].reshape(len(next_ids), -1)
        result = {"task": task.name, "setting": setting.name, "accuracy": acc, **metrics,
                  **invert_tokens(pub_act, collate(attack_public, "text").inputs, priv_act, priv_ids,
                                  tok.vocab_size, task.attack_steps, g),
                  **label_attacks(grads, next_ids, g)}
        log.info("%s", result)
        rows.append(result)
    return rows


# -- federated DP-SGD run through `flwr run` ------------------------------------------------------------------
def run_federated(rounds: int, local_steps: int, num_nodes: int = 4, **overrides: Any) -> dict[str, Any]:
    """The main job through ``flwr run . local`` with run-config ``overrides``; returns its per-round numbers.

    Raises:
        BenchError: the run did not complete.
    """
    from bench.flower import flwr_run

    with tempfile.TemporaryDirectory() as tmp:
        values = {"num-server-rounds": rounds, "local-steps": local_steps, **overrides}
        config = " ".join(f"{k}='{v}'" if isinstance(v, str) else f"{k}={v}" for k, v in values.items())
        started = time.perf_counter()
        history = flwr_run(config, Path(tmp) / "out", num_nodes)
    rounds_ = sorted(history["rounds"], key=lambda r: r["round"])
    return {"rounds": rounds, "local-steps": local_steps, "clients": num_nodes,
            "eval-accuracy": [r["evaluate"].get("eval-accuracy") for r in rounds_],
            "train-epsilon": [r["train"].get("train-epsilon") for r in rounds_],
            "noise-multiplier": rounds_[-1]["train"].get("train-dp-noise-multiplier"),
            "seconds": time.perf_counter() - started}


# -- command line ---------------------------------------------------------------------------------------------------
COLUMNS = [("task", "{}"), ("setting", "{}"), ("epsilon", "{:.3g}"), ("cut-epsilon", "{:.3g}"),
           ("cut-grad-epsilon", "{:.3g}"), ("accuracy", "{:.3f}"), ("inversion-ssim", "{:.3f}"),
           ("inversion-mse", "{:.4f}"), ("token-recovery-acc", "{:.3f}"), ("label-norm-auc", "{:.3f}"),
           ("label-cosine-auc", "{:.3f}"), ("label-1-shot-acc", "{:.3f}"), ("train-seconds", "{:.0f}")]


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of the harness rows ('-': not applicable)."""
    head = "| " + " | ".join(c for c, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = []
        for key, fmt in COLUMNS:
            value = row.get(key)
            cells.append("-" if value is None else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.leakage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="fewer training and attack steps")
    parser.add_argument("--only", nargs="*", choices=["mnist", "lm"], help="run only these tasks")
    parser.add_argument("--federated", action="store_true",
                        help="DP-SGD (epsilon 8, delta 1e-5) vs no privacy through the Flower apps, 4 clients")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--local-steps", type=int, default=30)
    parser.add_argument("--dp-lr", type=float, default=0.2, help="client learning rate of the DP-SGD run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=0, help="training steps per setting (default: the task's)")
    parser.add_argument("--attack-steps", type=int, default=0, help="inversion decoder steps (default: the task's)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: robust on a shared 2-core machine; more oversubscribes there)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    log.setLevel(logging.INFO)  # one line per setting on stderr
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    torch.manual_seed(args.seed)
    out: dict[str, Any] = {"machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}"}
    if args.federated:
        base = {"lr": 0.05, "batch-size": 64}
        plain = run_federated(args.rounds, args.local_steps, **base)
        private = run_federated(args.rounds, args.local_steps, **{
            **base, "lr": args.dp_lr, "trunk-lr": base["lr"], "dp-target-epsilon": 8.0, "dp-delta": 1e-5,
            "dp-max-grad-norm": 1.0})
        out.update({"no-privacy": plain, "dp-sgd": private})
        text = "\n".join(f"{name:>11}: eval accuracy by round {[round(a, 4) for a in r['eval-accuracy']]}, "
                         f"epsilon by round {r['train-epsilon']}, noise multiplier {r['noise-multiplier']}, "
                         f"{r['seconds']:.0f}s"
                         for name, r in [("no privacy", plain), ("DP-SGD", private)])
    else:
        rows: list[dict[str, Any]] = []
        started = time.perf_counter()
        budget = {k: v for k, v in (("steps", args.steps), ("attack_steps", args.attack_steps)) if v}
        if not args.only or "mnist" in args.only:
            rows += run_mnist(replace(mnist_task(args.quick), **budget), args.seed)
        if not args.only or "lm" in args.only:
            rows += run_lm(replace(lm_task(args.quick), **budget), args.seed)
        out.update({"rows": rows, "seconds": time.perf_counter() - started,
                    "command": "python -m bench.leakage" + (" --quick" if args.quick else "")})
        text = table(rows) + f"\n\n{out['machine']}; {out['seconds']:.0f} s"
    if args.json:
        json.dump(out, sys.stdout, indent=1, default=float)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
