"""The generating clients of ``bench.gen_batching``: the model every process builds alike, and the client processes.

Each client process builds the split model (seeded: the same weights as the server's trunk), then for each job it
is sent (a server's address, and whether to replay) generates once after a barrier that all clients share, or
replays one-position steps of precomputed hidden states, and reports its times and tokens.
"""

from __future__ import annotations

import time
from typing import Any

import torch


#: name -> (layers, hidden, heads, vocab, cuts)
MODELS: dict[str, tuple[int, int, int, int, tuple[int, int]]] = {
    "tiny": (6, 256, 4, 8192, (2, 4)),
    "gpt2-small": (14, 768, 12, 50257, (1, 13)),
}


def build(name: str, device: str) -> Any:
    """The split model (the same weights in every process: seeded initialisation)."""
    from transformers import GPT2LMHeadModel

    from splitfed.models.catalog import tiny_gpt2_config
    from splitfed.split import split_model

    layers, hidden, heads, vocab, cuts = MODELS[name]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2_config(vocab, layers=layers, hidden=hidden, heads=heads, positions=1024))
    return split_model(model.eval().to(device), cuts)


def replay_steps(channel: Any, hidden: torch.Tensor, steps: list[torch.Tensor]) -> None:
    """One session of precomputed hidden states: a prefill, then one-position steps; no bottom, top or sampling."""
    from splitfed.client.generation import RemoteSession
    from splitfed.split import CutState

    with RemoteSession(channel, max_length=hidden.shape[1] + len(steps)) as session:
        session.step(CutState(hidden))
        for h in steps:
            session.step(CutState(h))


class TimedSession:
    """A :class:`~splitfed.client.generation.RemoteSession` that adds up the time spent inside its steps."""

    def __init__(self, channel: Any, max_length: int) -> None:
        from splitfed.client.generation import RemoteSession

        self.inner = RemoteSession(channel, max_length=max_length).open()
        self.max_length = max_length
        self.batch_size = 1
        self.waited_s = 0.0

    @property
    def length(self) -> int:
        """Positions the server holds."""
        return self.inner.length

    def step(self, state: Any) -> torch.Tensor:
        """The session's step, timed from when the bottom's output is ready (a host copy waits for it anyway)."""
        if state.hidden.is_cuda:
            torch.cuda.current_stream().synchronize()
        start = time.perf_counter()
        try:
            return self.inner.step(state)
        finally:
            self.waited_s += time.perf_counter() - start

    def reset(self) -> None:
        """Open a fresh server-side session."""
        self.inner.reset()

    def close(self) -> None:
        """Close the server-side session."""
        self.inner.close()


def client(rank: int, name: str, device: str, prompt_len: int, new_tokens: int, jobs: Any, results: Any,
           barrier: Any, decode_steps: str = "auto") -> None:
    """One client process: for each (server address, replay) it is sent, generate once (after the barrier), or
    replay one-position steps when ``replay``, and report."""
    from splitfed.channel.client.trunk import TrunkClient
    from splitfed.client.generation import generate

    torch.set_num_threads(1)
    parts = build(name, device)
    _, width, _, vocab, _ = MODELS[name]
    length = prompt_len + rank  # different prompt lengths
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(3, vocab, (1, length), generator=g).to(device)
    prompt = torch.randn(1, length, width, generator=g).to(device)
    steps = [torch.randn(1, 1, width, generator=g).to(device) for _ in range(new_tokens)]
    while True:
        job = jobs.get()
        if job is None:
            return
        address, replay = job
        with TrunkClient(address, insecure=True, client_id=f"bench-{rank}") as channel:
            if replay:
                replay_steps(channel, prompt, steps[:2])  # warm-up
                barrier.wait()
                start, direct = time.perf_counter(), channel.shared.direct_calls
                replay_steps(channel, prompt, steps)
                results.put((rank, start, time.perf_counter(), [], 0.0, channel.shared.direct_calls - direct))
                continue
            generate(parts.bottom, channel, parts.top, ids, max_new_tokens=2)  # warm-up (connection, kernels)
            barrier.wait()
            session = TimedSession(channel, length + new_tokens)
            start, direct = time.perf_counter(), channel.shared.direct_calls
            try:
                out = generate(parts.bottom, session, parts.top, ids, max_new_tokens=new_tokens,
                               decode_steps=decode_steps)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
            finally:
                session.close()
            end = time.perf_counter()
            results.put((rank, start, end, out[0, length:].tolist(), end - start - session.waited_s,
                         channel.shared.direct_calls - direct))
