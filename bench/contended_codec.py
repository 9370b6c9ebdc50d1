"""What one decode step's codec work costs the event loop while the trunk's device thread runs.

The trunk server's event loop decodes each call's hidden state and encodes its reply on its own thread, while the
device thread runs the trunk's forward on the same interpreter. Each torch call the loop makes lets go of the
interpreter lock, and the device thread, launching its own torch calls, takes it in the meantime: a torch call on
the loop costs a hand-over of the lock both ways, not only its own few microseconds. This bench decodes and
encodes a ``(1, 1, hidden)`` tensor (a decode step's hidden state and its reply), as the server does, on one
thread: alone, then while another thread runs a small GPT-2's forward in a loop (torch calls between short
stretches of Python, as a device thread launching kernels does).

Keys, per dtype (``fp32``, ``bf16``): ``codec_step_quiet_us_<dtype>`` and ``codec_step_contended_us_<dtype>``
(wall time of one decode and one encode, the median of ``--repeat`` blocks), and
``codec_step_contention_ratio_<dtype>``, contended over quiet, measured in the same run.
``python -m bench.contended_codec --json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import threading
import time
from collections.abc import Callable

import torch

from bench import core
from splitfed.codec.tensors import decode, encode

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _per_call_us(call: Callable[[], object], calls: int, repeat: int) -> float:
    """Median over ``repeat`` blocks of ``calls`` calls: microseconds a call."""
    for _ in range(calls // 4):
        call()
    blocks = []
    for _ in range(repeat):
        began = time.perf_counter()
        for _ in range(calls):
            call()
        blocks.append((time.perf_counter() - began) / calls * 1e6)
    return statistics.median(blocks)


def measure(hidden: int = 768, calls: int = 400, repeat: int = 5) -> dict[str, float]:
    """The quiet and contended figures for each dtype (see the module docstring)."""
    from transformers import GPT2Config, GPT2Model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = GPT2Model(GPT2Config(n_layer=4, n_embd=64, n_head=2, vocab_size=128, bos_token_id=0, eos_token_id=0)).eval()
    steps = torch.randn(8, 1, 64)
    stop = threading.Event()

    def device_thread() -> None:
        with torch.no_grad():
            while not stop.is_set():
                model(inputs_embeds=steps)

    out: dict[str, float] = {"codec_step_hidden": float(hidden)}
    try:
        steps_of = {}
        for name, dtype in DTYPES.items():
            sent = encode("hidden", torch.randn(1, 1, hidden).to(dtype))
            received = dataclasses.replace(sent, data=bytes(sent.data))  # as it arrives: immutable bytes
            reply = torch.randn(1, 1, hidden).to(dtype)

            def step(received=received, reply=reply) -> None:
                decode(received)
                encode("hidden", reply)
            steps_of[name] = step
            out[f"codec_step_quiet_us_{name}"] = _per_call_us(step, calls, repeat)
        runner = threading.Thread(target=device_thread, name="device-like", daemon=True)
        runner.start()
        try:
            for name, step in steps_of.items():
                out[f"codec_step_contended_us_{name}"] = _per_call_us(step, calls, repeat)
        finally:
            stop.set()
            runner.join()
    finally:
        torch.set_num_threads(threads)
    for name in DTYPES:
        out[f"codec_step_contention_ratio_{name}"] = (out[f"codec_step_contended_us_{name}"]
                                                       / out[f"codec_step_quiet_us_{name}"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=768, help="the hidden state's width (default 768)")
    parser.add_argument("--calls", type=int, default=400, help="calls per timed block (default 400)")
    parser.add_argument("--repeat", type=int, default=5, help="timed blocks; the median is reported (default 5)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.hidden < 1 or args.calls < 1 or args.repeat < 1:
        parser.error("--hidden, --calls and --repeat must be positive")
    core.print_results(measure(args.hidden, args.calls, args.repeat), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
