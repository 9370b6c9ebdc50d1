"""Run the benchmarks and print their ratios (``--json``: one JSON object)."""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
from collections.abc import Callable

import torch

from bench import core, gen_batching, generation, split_step, strategies
from splitfed.tuning import tune_malloc

SUITES: dict[str, Callable[..., dict[str, float]]] = {
    "split_step": split_step.split_step_ratio,
    "channel": core.channel_vs_grpc,
    "codec": core.codec_speedup,
    "compression": core.compression,
    "generation": generation.generation,
    "gen_batching": gen_batching.gen_batching,
    "strategies": strategies.strategies_suite,
}
#: Suites that run only when ``--only`` names them (``strategies``: 16 ``flwr run`` jobs, 15-25 minutes on 2 cores;
#: ``python -m bench.strategies`` prints its table).
OPT_IN = ("strategies",)

#: ``--quick``: a tiny model and one repetition of everything (a smoke run: the figures mean nothing).
QUICK_SPLIT_STEP = {"layers": 3, "hidden": 32, "heads": 2, "vocab": 64, "batch": 2, "seq": 8}
QUICK: dict[str, dict[str, object]] = {
    "split_step": {"repeat": 1},
    "channel": {"sizes": (4 << 10, 64 << 10), "repeat": 1},
    "codec": {"size_mib": 1, "repeat": 1},
    "compression": {"repeat": 2},
    "generation": {"new_tokens": 4, "prompt_len": 4, "repeat": 1},
    "gen_batching": {"sessions": 2, "new_tokens": 4, "repeat": 1},
    "strategies": {"rounds": 1, "only": ("fedavg",)},
}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--only", nargs="*", choices=sorted(SUITES),
                        help=f"run only these suites (default: all but {', '.join(OPT_IN)})")
    parser.add_argument("--device", default="cpu", help="device for model benchmarks (cpu, cuda)")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model and one repetition of everything: checks that every suite runs")
    parser.add_argument("--split-config", default="", help='split-step model and batch, e.g. "layers=12 hidden=768 '
                        'heads=12 vocab=50257 batch=16 seq=512 bf16=1" (default: the tiny GPT-2)')
    parser.add_argument("--micro-batches", nargs="*", type=int, default=[1],
                        help="split_step: also time the step pipelined as k micro-batches, for each k (e.g. 1 4)")
    parser.add_argument("--wire-compression", default="none", choices=("none", "int8", "topk"),
                        help="split_step: what crosses the cut (int8: activations and gradients; topk: int8 "
                             "activations, top-k gradients)")
    parser.add_argument("--transports", nargs="*", default=["auto", "socket"], choices=split_step.TRANSPORTS,
                        help="split_step: auto (shared memory, client and trunk on one host), socket "
                             "(loopback TCP; keys with _socket), bulk (loopback TCP with a bulk link of 4 "
                             "connections; keys with _bulk), tls (gRPC over TLS; _tls) and/or bulk-tls (TLS with a "
                             "TLS bulk link; _bulk_tls)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    tune_malloc()  # as the trunk server and client do; applies to both sides of every comparison
    if args.quick:
        core.SPLIT_STEP.update(QUICK_SPLIT_STEP)
    try:
        core.set_split_step(args.split_config, "--split-config")
    except ValueError as exc:
        parser.error(str(exc))
    results: dict[str, object] = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
                   f"{torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'}",
    }
    for name in args.only or [n for n in SUITES if n not in OPT_IN]:
        fn = SUITES[name]
        kwargs = {"device": args.device} if "device" in fn.__code__.co_varnames else {}
        if args.quick:
            kwargs.update(QUICK[name])
        if "micro_batches" in fn.__code__.co_varnames:
            kwargs["micro_batches"] = tuple(args.micro_batches)
        if "wire_compression" in fn.__code__.co_varnames:
            kwargs["wire_compression"] = args.wire_compression
        if "transports" in fn.__code__.co_varnames:
            kwargs["transports"] = tuple(args.transports)
        results.update(fn(**kwargs))
    if "split_step" in (args.only or [n for n in SUITES if n not in OPT_IN]):
        results["split_step_config"] = " ".join(f"{k}={v}" for k, v in core.SPLIT_STEP.items())
        results["split_step_wire_compression"] = args.wire_compression
    core.print_results(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
