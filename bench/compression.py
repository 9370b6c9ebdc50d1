"""Compression at the cut on real runs: ``python -m bench.compression [--job mnist|llm] [--json FILE]``.

``--job mnist`` (default) runs the main job (``flwr run . local``: MNIST CNN, 4
IID clients, 5 rounds, the pyproject defaults) once per wire setting and prints,
per setting, the bytes at the cut per round (all clients, both directions,
training and evaluation) and the held-out accuracy after the last round.
``--job llm`` runs the SmolLM2-135M LoRA fine-tune of ``bench.llm_finetune``
(3 rounds; slow on CPU) and reports held-out perplexity instead. Each run gets a
SuperLink of its own (its own ``FLWR_HOME`` and ports), ended when it is done.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.flower import flwr_run

__all__ = ["LLM_JOB", "SETTINGS", "flwr_run", "main", "summarize"]

#: name -> run-config overrides.
SETTINGS: dict[str, str] = {
    "none": "wire-compression='none'",
    "int8": "wire-compression='int8'",
    "topk": "wire-compression='topk'",
    "int8 + topk gradients": "wire-compression='int8' wire-compression-grad='topk'",
    "int8 + topk, no feedback": "wire-compression='int8' wire-compression-grad='topk' wire-error-feedback=false",
}


#: The SmolLM2 LoRA fine-tune of ``bench.llm_finetune``.
LLM_JOB = ("model='smollm2-135m' cuts='3,27' lora-rank=8 optimizer='adamw' lr=0.0005 momentum=0.0 max-seq-len=128 "
           "batch-size=4 local-steps=8 num-server-rounds=3 partitioner='pathological' classes-per-partition=1 "
           "min-train-nodes=2 trunk-timeout=600.0")


def summarize(history: dict) -> dict[str, float]:
    """Bytes at the cut per round (mean over rounds, MB) and the last round's held-out accuracy."""
    rounds = sorted(history["rounds"], key=lambda r: r["round"])
    per_round = []
    train_per_round = []
    for r in rounds:
        t, e = r.get("train", {}), r.get("evaluate", {})
        train = t.get("train-bytes-sent", 0) + t.get("train-bytes-received", 0)
        per_round.append(train + e.get("eval-bytes-sent", 0) + e.get("eval-bytes-received", 0))
        train_per_round.append(train)
    failed = sum(int((r.get("failures") or {}).get(kind, 0)) for r in rounds for kind in ("train", "evaluate"))
    accuracy = [r.get("evaluate", {}).get("eval-accuracy") for r in rounds]
    perplexity = [r.get("evaluate", {}).get("eval-perplexity") for r in rounds]
    if accuracy[-1] is None:
        raise RuntimeError(f"the last round has no evaluation ({failed} failed client calls); see the run's logs")
    return {"mb_per_round": sum(per_round) / len(per_round) / 1e6,
            "train_mb_per_round": sum(train_per_round) / len(train_per_round) / 1e6,
            "final_accuracy": float(accuracy[-1]), "final_eval_loss": float(rounds[-1]["evaluate"]["eval-loss"]),
            "accuracy_by_round": accuracy, "perplexity_by_round": perplexity, "failed_client_calls": failed,
            "status": history.get("status")}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compression", description=__doc__)
    parser.add_argument("--only", nargs="*", choices=sorted(SETTINGS), help="run only these settings")
    parser.add_argument("--job", choices=("mnist", "llm"), default="mnist", help="the main job or the LLM fine-tune")
    parser.add_argument("--json", default="", help="also write the results to this file")
    parser.add_argument("--out", default="", help="keep each run's outputs in a folder here (default: a temporary one)")
    parser.add_argument("--extra", default="", help="run-config overrides for every run, e.g. \"num-server-rounds=1\"")
    parser.add_argument("--supernodes", type=int, default=4, help="SuperNodes of each run (default 4)")
    args = parser.parse_args()
    results: dict[str, dict] = {}
    job = ""
    if args.job == "llm":
        from splitfed.models.llm import model_dir

        model_dir("smollm2-135m")  # convert the GGUF once, before the clients race for it
        job = LLM_JOB + " "
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or list(SETTINGS):
            start = time.perf_counter()
            out = Path(args.out or tmp) / name.replace(" ", "-").replace("+", "and")
            results[name] = summarize(flwr_run(f"{job}{SETTINGS[name]} {args.extra}".strip(), out, args.supernodes))
            results[name]["seconds"] = time.perf_counter() - start
            results[name]["run_config"] = SETTINGS[name]
            sys.stdout.write(f"{name:<24} {json.dumps(results[name])}\n")
            sys.stdout.flush()
    base = results.get("none")
    sys.stdout.write(f"\n{'setting':<24} {'MB/round':>9} {'ratio':>6} {'accuracy':>9}\n")
    for name, r in results.items():
        ratio = base["mb_per_round"] / r["mb_per_round"] if base else float("nan")
        quality = r["perplexity_by_round"][-1] if args.job == "llm" else r["final_accuracy"]
        sys.stdout.write(f"{name:<24} {r['mb_per_round']:9.2f} {ratio:6.2f} {quality:9.4f}\n")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
