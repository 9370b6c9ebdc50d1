"""Split generation: bytes per token with and without the server-side KV cache, and latency against unsplit.

* ``gen_bytes_per_token_cache``: bytes on the split channel (both directions)
  per generated token when the trunk keeps its KV cache in a session: each step
  sends one position's hidden state (plus the 1-byte-per-position mask) and gets
  one back.
* ``gen_bytes_per_token_nocache``: the same without a cache: every step resends
  the whole sequence's hidden states through the same channel with an
  evaluation forward and gets the whole sequence's output back.
* ``gen_latency_ratio``: per-token latency of split generation over loopback
  (trunk server in a thread of this process) / the unsplit model's
  ``generate(do_sample=False)``, measured interleaved.
* ``gen_client_decode_steps``: how the client's bottom and top stepped
  (``graphs``, ``fixed`` or ``dynamic``: ``generate(decode_steps=...)``,
  ``--client-decode-steps``); where not ``dynamic``,
  ``gen_latency_ratio_client_dynamic`` is the ratio again with the client's parts
  over their growing caches, in the same run.
* ``gen_latency_ratio_static`` (``--static-baseline``): split generation / the
  unsplit model's ``generate(cache_implementation="static")``, measured
  interleaved: a fixed-size cache, whose forward ``transformers`` compiles on a
  GPU (CUDA graphs: the unsplit model's fastest way), where the default baseline
  launches every kernel; ``gen_unsplit_static_ms_per_token``,
  ``gen_greedy_match_static`` (its tokens against the split model's) and
  ``gen_static_first_s`` (its first generation, the compile included) with it.
* ``gen_latency_ratio_process``: the same with the trunk server in a process of
  its own (as a deployment runs it: the client's Python and the server's do not
  take turns on one interpreter lock), timed interleaved with the unsplit model.
* ``gen_direct_share`` (``gen_direct_share_process``): the share of a generation's
  Forward calls (its prefill and decode steps) that went over the client's
  shared-memory region's direct-call link rather than gRPC (a client on the
  trunk's host opens a region for the link with its first call).

Default model: a tiny Llama built in code (6 layers, hidden 256, vocab 8192);
``python -m bench.generation --gen-model NAME_OR_DIR`` runs it on a real model.
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import time
from typing import Any

import torch

from bench.core import interleaved, print_results


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    """A tiny Llama (6 layers, hidden 256, 4 heads / 2 KV heads, vocab 8192), randomly initialised."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


def load_model(name: str | None) -> torch.nn.Module:
    """The benchmark's model: the tiny Llama, a named LLM (``splitfed.models.llm``), a local folder or a hub id."""
    if not name:
        return tiny_llama()
    from splitfed.models.llm import load_model as load_llm

    return load_llm(name).eval()


def _nocache_generate(bottom: Any, client: Any, top: Any, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy generation without any cache: every step runs all positions and sends them all to the trunk."""
    from splitfed.split import CutState

    with torch.no_grad():
        for _ in range(new_tokens):
            state = bottom(ids)
            hidden, _ = client.forward(state, train=False)
            logits = top(CutState(hidden.to(ids.device, copy=True), state.attention_mask, state.position_ids))
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def _trunk_parts(model: str | None, cuts: tuple[int, int] | None, device: str) -> tuple[Any, Any, tuple[int, int]]:
    """The reference model and the split parts of a copy of it, at ``cuts`` (default: a named model's, else thirds
    of the blocks). Loading is deterministic, so another process gets the same parts."""
    from splitfed.split import num_blocks, split_model

    ref = load_model(model).to(device)
    split = copy.deepcopy(ref)  # splitting re-indexes the layers; the reference keeps its own
    n = num_blocks(split)
    if cuts is None and model:
        from splitfed.models.llm import NAMED_LLMS

        cuts = NAMED_LLMS[model].default_cuts if model in NAMED_LLMS else None
    cuts = cuts or (max(n // 3, 1), max(2 * n // 3, 2))
    parts = split_model(split, cuts)
    parts.trunk.requires_grad_(False)
    return ref, parts, cuts


def _serve_trunk(model: str | None, cuts: tuple[int, int], device: str, threads: int, port_queue: Any,
                 stop: Any, decode_steps: str) -> None:
    """Serve the model's trunk from this (spawned) process until ``stop`` is set."""
    from splitfed.channel.server.trunkserver import TrunkServer
    from splitfed.trunk.inference.sessions import SessionLimits

    torch.set_num_threads(threads)
    _, parts, _ = _trunk_parts(model, cuts, device)
    server = TrunkServer(parts.trunk, insecure=True, session_limits=SessionLimits(decode_steps=decode_steps)).start()
    port_queue.put(server.port)
    stop.wait()
    server.stop(grace=0)


def generation(new_tokens: int = 128, prompt_len: int = 16, model: str | None = None,
               cuts: tuple[int, int] | None = None, repeat: int = 3, device: str = "cpu",
               decode_steps: str = "auto", client_decode_steps: str = "auto", static_baseline: bool = False
               ) -> dict[str, float]:
    """Bytes per token with and without the trunk's KV cache, and split / unsplit per-token latency.

    Args:
        new_tokens: tokens generated per run (every run generates exactly this many).
        prompt_len: random prompt length.
        model: None for the tiny Llama, else a named LLM, a local folder or a hub id.
        cuts: cut points (default: a named model's cuts, else thirds of the blocks).
        repeat: interleaved timed runs of each side (medians are reported).
        device: where the model runs (cpu, cuda).
        decode_steps: the trunk servers' ``decode_steps`` (:mod:`splitfed.trunk.inference.fixedsteps`).
        client_decode_steps: the client's ``generate(decode_steps=...)`` (:mod:`splitfed.client.decoding`).
        static_baseline: also time the unsplit model over a static cache (``gen_latency_ratio_static``).
    """
    import multiprocessing as mp

    from bench.processes import check_alive, end_children, get_from
    from splitfed.channel.client.trunk import TrunkClient
    from splitfed.channel.server.trunkserver import TrunkServer
    from splitfed.client.decoding import decoder_kind
    from splitfed.client.generation import generate
    from splitfed.trunk.inference.sessions import SessionLimits

    ref, parts, cuts = _trunk_parts(model, cuts, device)
    ctx = mp.get_context("spawn")
    port_queue, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_serve_trunk, args=(model, cuts, device, torch.get_num_threads(), port_queue, stop,
                                                         decode_steps),
                       daemon=True)
    proc.start()
    server: Any = None
    client: Any = None
    remote: Any = None
    vocab = ref.config.vocab_size
    ids = torch.randint(3, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(0)).to(device)
    out: dict[str, float] = {}
    try:
        # The other process's server is up before anything is timed (its start-up would weigh on the timings).
        port = get_from(port_queue, [proc], 300, "the trunk server process's port")
        remote = TrunkClient(f"127.0.0.1:{port}", insecure=True)
        server = TrunkServer(parts.trunk, insecure=True, session_limits=SessionLimits(decode_steps=decode_steps)).start()
        client = TrunkClient(server.address, insecure=True)

        def count(fn: Any) -> tuple[float, Any]:
            before = client.bytes_sent + client.bytes_received
            result = fn()
            return (client.bytes_sent + client.bytes_received - before) / new_tokens, result

        def split_gen() -> torch.Tensor:
            return generate(parts.bottom, client, parts.top, ids, max_new_tokens=new_tokens,
                            decode_steps=client_decode_steps)

        def unsplit_gen() -> torch.Tensor:
            return ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                pad_token_id=ref.generation_config.pad_token_id or 0)

        def direct_share(channel: Any, fn: Any) -> tuple[float, Any]:
            calls, direct = channel.calls, channel.shared.direct_calls
            result = fn()
            return (channel.shared.direct_calls - direct) / max(channel.calls - calls, 1), result

        out["gen_bytes_per_token_cache"], (out["gen_direct_share"], got) = count(lambda: direct_share(client,
                                                                                                    split_gen))
        out["gen_greedy_match"] = float(torch.equal(got, unsplit_gen()))
        start = time.perf_counter()
        out["gen_bytes_per_token_nocache"], _ = count(lambda: _nocache_generate(parts.bottom, client, parts.top,
                                                                                ids, new_tokens))
        t_nocache = time.perf_counter() - start
        t_split, t_unsplit = interleaved(split_gen, unsplit_gen, repeat, warmup=1)
        out["gen_latency_ratio"] = t_split / t_unsplit
        out["gen_split_ms_per_token"] = t_split / new_tokens * 1e3
        out["gen_unsplit_ms_per_token"] = t_unsplit / new_tokens * 1e3
        kind = decoder_kind(parts.bottom, parts.top, client_decode_steps, new_tokens)
        out["gen_client_decode_steps"] = kind or "dynamic"
        if kind is not None:  # the same split generation with the client's parts over their growing caches
            t_dynamic, t_unsplit = interleaved(
                lambda: generate(parts.bottom, client, parts.top, ids, max_new_tokens=new_tokens,
                                 decode_steps="dynamic"), unsplit_gen, repeat, warmup=1)
            out["gen_latency_ratio_client_dynamic"] = t_dynamic / t_unsplit
        if static_baseline:
            _static_baseline(out, ref, ids, new_tokens, split_gen, got, repeat)
        out["gen_nocache_ms_per_token"] = t_nocache / new_tokens * 1e3
        out["gen_new_tokens"] = float(new_tokens)

        def process_gen() -> torch.Tensor:
            return generate(parts.bottom, remote, parts.top, ids, max_new_tokens=new_tokens,
                            decode_steps=client_decode_steps)

        out["gen_direct_share_process"], got = direct_share(remote, process_gen)
        out["gen_greedy_match_process"] = float(torch.equal(got, unsplit_gen()))
        t_process, t_unsplit = interleaved(process_gen, unsplit_gen, repeat, warmup=1)
        out["gen_latency_ratio_process"] = t_process / t_unsplit
        out["gen_split_process_ms_per_token"] = t_process / new_tokens * 1e3
        check_alive([proc], "the trunk server process")
        return out
    finally:
        for channel in (client, remote):
            if channel is not None:
                channel.close()
        if server is not None:
            server.stop(grace=0)
        stop.set()
        end_children([proc])


def _static_baseline(out: dict[str, Any], ref: Any, ids: torch.Tensor, new_tokens: int, split_gen: Any,
                     split_tokens: torch.Tensor, repeat: int) -> None:
    """Time split generation against the unsplit model over a static cache (compiled by ``transformers`` on a
    GPU) into ``out``; the first, compiling generation is timed apart and its tokens checked."""
    def static_gen() -> torch.Tensor:
        return ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens, pad_token_id=ref.generation_config.pad_token_id or 0,
                            cache_implementation="static")

    start = time.perf_counter()
    first = static_gen()
    out["gen_static_first_s"] = time.perf_counter() - start
    out["gen_greedy_match_static"] = float(torch.equal(first, split_tokens))
    t_split, t_static = interleaved(split_gen, static_gen, repeat, warmup=1)
    out["gen_latency_ratio_static"] = t_split / t_static
    out["gen_unsplit_static_ms_per_token"] = t_static / new_tokens * 1e3


def main() -> int:
    """``python -m bench.generation [--gen-model NAME] [--new-tokens N] [--json]``."""
    from splitfed.client.decoding import CLIENT_DECODE_STEPS
    from splitfed.trunk.inference.fixedsteps import DECODE_STEPS

    parser = argparse.ArgumentParser(prog="python -m bench.generation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gen-model", help="local folder, named LLM or hub id (default: the tiny Llama)")
    parser.add_argument("--cuts", help="A,B (default: a named model's cuts, else thirds of the blocks)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--decode-steps", choices=DECODE_STEPS, default="auto",
                        help="the trunk servers' decode steps (auto: CUDA graphs on a GPU)")
    parser.add_argument("--client-decode-steps", choices=CLIENT_DECODE_STEPS, default="auto",
                        help="the client's bottom and top decode steps (auto: CUDA graphs on a GPU)")
    parser.add_argument("--static-baseline", action="store_true",
                        help="also time the unsplit model over a static cache, compiled on a GPU "
                             "(gen_latency_ratio_static)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cuts = None
    if args.cuts:
        a, b = (int(x) for x in args.cuts.split(","))
        cuts = (a, b)
    results = generation(args.new_tokens, args.prompt_len, args.gen_model, cuts, args.repeat, args.device,
                         args.decode_steps, args.client_decode_steps, args.static_baseline)
    print_results(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
