"""A step's tensors brought to the device while the rest of the step comes (``splitfed.trunk.device.early``).

The clients' calls come one after another (0.15 s apart), through shared-memory regions, into a window that
closes when the last member is in: the device thread brings the forwards already in the window, and the
gradients already in for the batch, a chunk at a time. The outcome must be that of bringing them all at the end,
NaN and Inf refused included.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch
from conftest import tiny_model

from splitfed.channel.client.trunk import TrunkClient
from splitfed.errors import ChannelError
from splitfed.split import CutState, split_model
from splitfed.trunk.aggregation.modes import make_aggregator
from splitfed.trunk.device.early import chunk

CLIENTS = 8
GAP_S = 0.15  # between two clients' calls: each early bring has time to happen before the next call


def _state(i: int) -> CutState:
    # 2 x 256 x 32 fp32 = 64 KiB: large enough to cross in a region and to arrive in host memory (an Arrival).
    return CutState(torch.randn(2, 256, 32, generator=torch.Generator().manual_seed(i)))


def _run(trunk_server, early: bool, bad: dict[int, str] | None = None):
    """One sync step of ``CLIENTS`` clients, their calls staggered; ``bad``: client -> "forward" or "backward",
    whose tensor holds NaN there. Returns the trunk, the server and each client's (output, input gradient,
    outcome) or its error."""
    bad = bad or {}
    torch.manual_seed(0)
    split = split_model(tiny_model("gpt2").train(), cuts=(1, 3))
    server = trunk_server(split.trunk, lr=0.1, aggregator=make_aggregator("sync", timeout=60),
                          batch_window_ms=60_000)
    server.runtime.bring_early = early
    results: dict[int, object] = {}
    start = threading.Barrier(CLIENTS)

    def client(i: int) -> None:
        with TrunkClient(server.address, insecure=True, client_id=f"e{i}", shared_memory="on") as c:
            c.join()
            start.wait(30)
            t0 = time.monotonic()
            state = _state(i)
            if bad.get(i) == "forward":
                state.hidden[0, 3, 5] = float("nan")
            time.sleep(i * GAP_S)
            act = uuid.uuid4().hex
            try:
                out, _ = c.forward(state, activation_id=act, train=True, num_examples=2)
                grad = torch.sin(out * (1 + i))
                if bad.get(i) == "backward":
                    grad[1, 7, 2] = float("inf")
                time.sleep(max(0.0, t0 + (CLIENTS + i) * GAP_S - time.monotonic()))  # staggered again
                reply = c.backward(act, grad)
                results[i] = (out, reply.grad, reply.outcome)
            except ChannelError as exc:
                results[i] = exc

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == list(range(CLIENTS)), "a client did not finish"
    return split.trunk, server, results


def test_bringing_early_trains_exactly_as_bringing_at_the_end(trunk_server) -> None:
    trunk, server, results = _run(trunk_server, early=False)
    e_trunk, e_server, e_results = _run(trunk_server, early=True)
    # It really happened: forwards brought while the window was open, gradients while the batch waited.
    assert e_server.scheduler.stats["early-brings"] >= 1
    assert e_server.scheduler.stats["early-brought"] >= chunk(CLIENTS)
    assert e_server.runtime._batches.stats["early-gradient-brings"] >= 1
    assert server.scheduler.stats["early-brings"] == 0
    assert server.runtime._batches.stats["early-gradient-brings"] == 0
    assert server.scheduler.stats["forward-batches"] == e_server.scheduler.stats["forward-batches"] == 1
    for i in range(CLIENTS):
        out, grad_in, outcome = results[i]
        e_out, e_grad, e_outcome = e_results[i]
        assert outcome == e_outcome == "APPLIED"
        assert torch.equal(out, e_out), i
        assert torch.equal(grad_in, e_grad), i
    for p, q in zip(trunk.parameters(), e_trunk.parameters()):
        assert torch.equal(p, q)
    assert server.runtime.version == e_server.runtime.version == 1


@pytest.mark.parametrize("early", [False, True])
def test_nan_brought_early_is_refused_and_the_others_step(trunk_server, early: bool) -> None:
    """Client 0's activation and client 1's gradient hold NaN/Inf; both are in the first chunk brought early.
    Each is refused with INVALID_ARGUMENT, as when brought at the end, and the other six step."""
    trunk, server, results = _run(trunk_server, early=early, bad={0: "forward", 1: "backward"})
    for i in (0, 1):
        assert isinstance(results[i], ChannelError) and results[i].code == "INVALID_ARGUMENT", results[i]
        assert "NaN or Inf" in str(results[i])
    assert {results[i][2] for i in range(2, CLIENTS)} == {"APPLIED"}  # type: ignore[index]
    assert server.runtime.version == 1
    assert all(torch.isfinite(p).all() for p in trunk.parameters())
    if early:  # refused where it was brought, in the first chunk
        assert server.scheduler.stats["early-refused"] == 1
        assert server.runtime._batches.stats["early-gradient-brings"] >= 1
    else:
        assert server.scheduler.stats["early-brings"] == 0


def test_an_early_bring_that_fails_leaves_the_gradients_to_the_batchs_backward(trunk_server, monkeypatch) -> None:
    """The first early bring of gradients fails after taking them: they go back to the batch, whose backward
    brings them again, and every member's step applies."""
    from splitfed.trunk.compute.batched import Batcher

    verdicts = Batcher._verdicts
    calls: list[int] = []

    def failing_once(taken, brought):
        calls.append(len(taken))
        if len(calls) == 1:
            raise RuntimeError("copy failed")
        return verdicts(taken, brought)

    monkeypatch.setattr(Batcher, "_verdicts", staticmethod(failing_once))
    trunk, server, results = _run(trunk_server, early=True)
    assert len(calls) >= 2
    assert {results[i][2] for i in range(CLIENTS)} == {"APPLIED"}  # type: ignore[index]
    assert server.runtime.version == 1
    assert sum(calls[1:]) >= calls[0]  # what the failed bring took was brought again
