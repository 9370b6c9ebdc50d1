"""Trunk activation checkpointing: saved bytes per forward and backward step time, with and without.

``python -m bench.checkpointing`` (GPT-2 small trunk, blocks 4-7, one sequence of 512 tokens by default).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench import core


def measure(checkpointing: bool, batch: int, seq: int, repeat: int, device: str) -> tuple[int, float]:
    """(bytes the trunk holds per saved forward, median seconds of forward + backward)."""
    from splitfed.split import CutState, split_model
    from splitfed.trunk.aggregation.modes import make_aggregator
    from splitfed.trunk.compute.runtime import TrunkRuntime

    trunk = split_model(core._gpt2().to(device), core._cuts()).trunk
    rt = TrunkRuntime(trunk, torch.optim.SGD(trunk.parameters(), lr=1e-4), aggregator=make_aggregator("async"),
                      checkpointing=checkpointing)
    hidden = torch.randn(batch, seq, core.SPLIT_STEP["hidden"], device=device)
    grad = torch.randn_like(hidden) * 1e-3
    held, times = 0, []
    for i in range(repeat + 1):
        start = time.perf_counter()
        rt.forward("c", f"a{i}", CutState(hidden), train=True)
        held = rt.store.forward_bytes
        rt.backward("c", f"a{i}", grad)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return held, statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.checkpointing", description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--config", default="", help='the model, as bench.trunk\'s --config (default: GPT-2 small, '
                        '"layers=12 hidden=768 heads=12 vocab=50257")')
    args = parser.parse_args()
    core.SPLIT_STEP.update(layers=12, hidden=768, heads=12, vocab=50257, seq=args.seq)
    try:
        core.set_split_step(args.config)
    except ValueError as exc:
        parser.error(str(exc))
    plain = measure(False, args.batch, args.seq, args.repeat, args.device)
    ckpt = measure(True, args.batch, args.seq, args.repeat, args.device)
    print(json.dumps({"saved_forward_bytes": plain[0], "saved_forward_bytes_checkpointing": ckpt[0],
                      "saved_bytes_ratio": plain[0] / ckpt[0], "step_s": plain[1], "step_s_checkpointing": ckpt[1],
                      "step_time_ratio": ckpt[1] / plain[1], "batch": args.batch, "seq": args.seq}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
