"""Faults: lost replies and retries (never applied twice), clients that die mid-step in every trunk mode,
bounded give-up, and memory that returns to baseline."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch
from conftest import batch_for, tiny_model

from splitfed.channel.client.remote import RemoteTrunk
from splitfed.channel.client.trunk import RetryPolicy, TrunkClient
from splitfed.channel.wire.limits import RETRY_KEYS
from splitfed.errors import ChannelError
from splitfed.split import CutState, SplitModel, split_model
from splitfed.trunk.aggregation.modes import make_aggregator
from splitfed.trunk.compute.store import StoreLimits


class LoseReplies(grpc.aio.ServerInterceptor):
    """Fault injection: Forward/Backward run, then the first attempt's reply is lost (UNAVAILABLE);
    optionally the first attempt fails before it runs."""

    def __init__(self, before: bool = False) -> None:
        self.before = before
        self.injected = 0
        self.retries_seen = 0

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.endswith(("/Forward", "/Backward")):
            return handler
        inner = handler.unary_unary

        async def behavior(request, context):
            md = dict(context.invocation_metadata())  # a retry over gRPC, or over a region's direct-call link
            if any(md.get(key, "0") not in ("", "0") for key in RETRY_KEYS):
                self.retries_seen += 1
                return await inner(request, context)
            self.injected += 1
            if self.before:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "injected fault before the handler")
            response = await inner(request, context)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "injected fault: reply lost")
            return response

        return grpc.unary_unary_rpc_method_handler(behavior, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


def _train(trunk_server, interceptors, steps: int = 4):
    model = tiny_model("gpt2").train()
    split = split_model(model, cuts=(1, 3))
    server = trunk_server(split.trunk, optimizer="adamw", lr=0.01, interceptors=interceptors)
    remote = RemoteTrunk(server.address, insecure=True, retry=RetryPolicy(initial_backoff_s=0.05))
    client = SplitModel(split.bottom, remote, split.top, task="causal-lm")
    opt = torch.optim.AdamW(split.client_modules().parameters(), lr=0.01)
    ids, mask, labels = batch_for("gpt2")
    for _ in range(steps):
        client(ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, server


# A reply lost after the handler ran (before=False) is tests/conformance/test_retries.py, over every transport.
@pytest.mark.parametrize("before", [True])
def test_retried_requests_are_never_applied_twice(trunk_server, before: bool) -> None:
    clean, clean_server = _train(trunk_server, [])
    faults = LoseReplies(before=before)
    faulty, faulty_server = _train(trunk_server, [faults])
    assert faults.injected == 8 and faults.retries_seen == 8  # every Forward and Backward, once each
    assert faulty_server.runtime.version == clean_server.runtime.version == 4
    assert faulty_server.runtime.stats["forwards"] == clean_server.runtime.stats["forwards"]
    for (name, a), b in zip(clean.state_dict().items(), faulty.state_dict().values()):
        assert torch.equal(a, b), name


def test_client_gives_up_with_a_clear_error_after_a_bounded_time() -> None:
    client = TrunkClient("127.0.0.1:9", insecure=True, retry=RetryPolicy(timeout_s=2.0, initial_backoff_s=0.1))
    start = time.monotonic()
    with pytest.raises(ChannelError, match="failed with") as info:
        client.forward(CutState(torch.randn(1, 2, 4)), train=False)
    assert time.monotonic() - start < 10
    assert info.value.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")


def _dying_client(address: str, ready, hidden: torch.Tensor) -> None:
    """Joins, sends one training forward, says so, then waits to be killed (no backward ever)."""
    client = TrunkClient(address, insecure=True, client_id="doomed")
    client.join()
    client.forward(CutState(hidden), train=True)
    ready.set()
    time.sleep(600)


def _dying_client_when_told(orders, ready) -> None:  # type: ignore[no-untyped-def]
    """Waits for its server's address and its hidden states, then dies as :func:`_dying_client` does."""
    address, hidden = orders.get()
    _dying_client(address, ready, hidden)


KILLED_MODES = ("sync", "quorum", "async")


@pytest.fixture(scope="module")
def doomed() -> Iterator[Callable[[str, torch.Tensor], Any]]:
    """One client process per test of :data:`KILLED_MODES`, all started at once when the first test asks (each
    spends its seconds importing, side by side); ``doomed(address, hidden)`` hands the next its server and
    returns it once its forward is in."""
    ctx = mp.get_context("spawn")
    spares = []
    for _ in KILLED_MODES:
        orders, ready = ctx.Queue(), ctx.Event()
        proc = ctx.Process(target=_dying_client_when_told, args=(orders, ready), daemon=True)
        proc.start()
        spares.append((proc, orders, ready))
    left = list(spares)

    def take(address: str, hidden: torch.Tensor) -> Any:
        proc, orders, ready = left.pop(0)
        orders.put((address, hidden))
        assert ready.wait(120)
        return proc

    yield take
    for proc, _, _ in spares:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


@pytest.mark.parametrize("mode", KILLED_MODES)
def test_a_client_killed_mid_step_does_not_block_the_others(trunk_server, doomed, mode: str) -> None:
    split = split_model(tiny_model("llama").train(), cuts=(1, 3))
    agg = make_aggregator(mode, quorum=2, max_staleness=4, timeout=1.0)
    server = trunk_server(split.trunk, aggregator=agg, store_limits=StoreLimits(ttl_s=1.5, done_ttl_s=1.5))
    hidden = torch.randn(2, 5, 32)
    proc = doomed(server.address, hidden)
    assert server.runtime.store.bytes_held > 0
    proc.kill()  # mid-step: its forward is saved, its backward will never come
    proc.join(10)
    survivor = TrunkClient(server.address, insecure=True, client_id="survivor")
    survivor.join()
    waits: list[float] = []  # how long each gradient waited for its step (compute time excluded)
    agg.observer = lambda kind, value: waits.append(value) if kind == "wait_seconds" else None
    for _ in range(4):
        act = uuid.uuid4().hex
        out, _ = survivor.forward(CutState(hidden), activation_id=act, train=True)
        reply = survivor.backward(act, torch.ones_like(out))
        assert reply.outcome == "APPLIED"
    # The dead client holds up at most the first step, by at most one timeout; then it is out of the group
    # (the quorum shrinks to the live members) and every later step waits for nobody.
    assert len(waits) == 4 and waits[0] <= 1.0 + 0.5 and max(waits[1:]) < 0.1, waits
    assert server.runtime.version >= 4
    deadline = time.monotonic() + 3  # async steps never wait for it; its membership expires after the timeout
    while "doomed" in server.runtime.aggregator.members and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "doomed" not in server.runtime.aggregator.members
    survivor.leave()
    # The dead client's saved forward is evicted after its TTL: memory back to baseline.
    deadline = time.monotonic() + 10
    while server.runtime.store.bytes_held and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.runtime.store.bytes_held == 0 and len(server.runtime.store) == 0
    assert server.runtime.store.evicted >= 1


def test_saved_forward_byte_budget_is_enforced_and_recovers(trunk_server) -> None:
    split = split_model(tiny_model("llama").train(), cuts=(1, 3))
    server = trunk_server(split.trunk, store_limits=StoreLimits(max_bytes=1_000_000, ttl_s=60))
    client = TrunkClient(server.address, insecure=True)
    held = []
    with pytest.raises(ChannelError) as info:
        for _ in range(50):
            act = uuid.uuid4().hex
            out, _ = client.forward(CutState(torch.randn(4, 16, 32)), activation_id=act, train=True)
            held.append((act, out))
    assert info.value.code == "RESOURCE_EXHAUSTED" and "budget" in str(info.value)
    assert len(held) >= 2 and server.runtime.store.bytes_held <= 1_000_000
    for act, out in held:  # finishing the held forwards frees the budget
        client.backward(act, torch.zeros_like(out))
    store = server.runtime.store
    assert store.forward_bytes == 0 and store.bytes_held == store.done_bytes > 0  # answers kept for retries
    for _ in range(len(held)):  # ... give way to new forwards: they only serve retries
        client.forward(CutState(torch.randn(4, 16, 32)), train=True)
    assert store.bytes_held <= 1_000_000


def test_concurrent_clients_in_sync_mode_step_together(trunk_server) -> None:
    split = split_model(tiny_model("llama").train(), cuts=(1, 3))
    server = trunk_server(split.trunk, aggregator=make_aggregator("sync", timeout=30))
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            c = TrunkClient(server.address, insecure=True, client_id=f"c{i}")
            c.join()
            for _ in range(5):
                act = uuid.uuid4().hex
                out, _ = c.forward(CutState(torch.randn(2, 5, 32)), activation_id=act, train=True)
                c.backward(act, torch.ones_like(out) * 0.01)
            c.leave()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    stats = server.runtime.aggregator.stats
    assert stats["applied"] == 20 and stats["steps"] < 20  # gradients were averaged in shared steps


def test_forwards_dropped_without_backward_free_their_activations() -> None:
    """Evicted or rebased forwards must not leave their autograd graph behind (a cycle through C++)."""
    import gc
    import weakref

    from splitfed.trunk.compute.runtime import TrunkRuntime

    split = split_model(tiny_model("llama").train(), cuts=(1, 3))
    rt = TrunkRuntime(split.trunk, torch.optim.SGD(split.trunk.parameters(), lr=0.1),
                      aggregator=make_aggregator("async", max_staleness=8))
    refs = []
    for i in range(3):
        rt.forward("c", f"a{i}", CutState(torch.randn(2, 5, 32)), train=True)
        refs.append(weakref.ref(rt.store.find(f"a{i}").output))
    out, _ = rt.forward("d", "b", CutState(torch.randn(2, 5, 32)), train=True)
    rt.backward("d", "b", torch.ones_like(out))  # steps the trunk: a0..a2 are rebased (graphs dropped)
    rt.forget("c", "a0")
    gc.collect()
    assert all(r() is None for r in refs)


class LoseStreamReplies(grpc.aio.ServerInterceptor):
    """Fault injection for streamed calls: the first attempt runs in full, then its reply is lost."""

    def __init__(self) -> None:
        self.injected = 0
        self.retries_seen = 0

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.endswith(("/ForwardStream", "/BackwardStream")):
            return handler
        inner = handler.stream_stream

        async def behavior(requests, context):
            md = dict(context.invocation_metadata())
            if md.get("x-splitfed-retry", "0") != "0" or "grpc-previous-rpc-attempts" in md:
                self.retries_seen += 1
                async for reply in inner(requests, context):
                    yield reply
                return
            self.injected += 1
            async for _ in inner(requests, context):
                pass
            await context.abort(grpc.StatusCode.UNAVAILABLE, "injected fault: reply lost")

        return grpc.stream_stream_rpc_method_handler(behavior, request_deserializer=handler.request_deserializer,
                                                     response_serializer=handler.response_serializer)


def _train_streamed(trunk_server, interceptors, steps: int = 3):
    from splitfed.channel.server.trunkserver import ChannelLimits

    model = tiny_model("gpt2").train()
    split = split_model(model, cuts=(1, 3))
    limits = ChannelLimits(max_message_bytes=256 << 10, stream_threshold_bytes=64 << 10, chunk_bytes=16 << 10)
    server = trunk_server(split.trunk, optimizer="adamw", lr=0.01, limits=limits, interceptors=interceptors,
                          metrics_port=0)
    remote = RemoteTrunk(server.address, insecure=True, limits=limits, retry=RetryPolicy(initial_backoff_s=0.05),
                         shared_memory="off")  # the socket's streams are under test
    client = SplitModel(split.bottom, remote, split.top, task="causal-lm")
    opt = torch.optim.AdamW(split.client_modules().parameters(), lr=0.01)
    ids, mask, labels = batch_for("gpt2", batch=10, length=64)  # 10 x 64 x 32 fp32 = 80 KiB: streamed both ways
    for _ in range(steps):
        client(ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, server


def test_streamed_calls_are_used_above_the_unary_limit_and_retried_exactly_once(trunk_server) -> None:
    import urllib.request

    clean, clean_server = _train_streamed(trunk_server, [])
    faults = LoseStreamReplies()
    faulty, faulty_server = _train_streamed(trunk_server, [faults])
    assert faults.injected == faults.retries_seen == 6  # every ForwardStream and BackwardStream, once each
    assert faulty_server.runtime.version == clean_server.runtime.version == 3
    assert faulty_server.runtime.stats["forwards"] == clean_server.runtime.stats["forwards"] == 3
    for (name, a), b in zip(clean.state_dict().items(), faulty.state_dict().values()):
        assert torch.equal(a, b), name
    body = urllib.request.urlopen(f"http://127.0.0.1:{clean_server.metrics_port}/metrics").read().decode()
    assert 'splitfed_rpc_total{code="OK",method="ForwardStream",model=""} 3.0' in body
    assert 'splitfed_rpc_total{code="OK",method="BackwardStream",model=""} 3.0' in body
    assert 'splitfed_rpc_total{code="OK",method="Forward",model=""} 0.0' in body
