"""The event-driven trunk under concurrency and faults: waiting costs no thread, silent members are dropped,
failed steps are all-or-nothing, held memory is counted and bounded, replies never outgrow their transport,
identity is checked before a payload is read, cancelled calls stay quiet, sessions retry exactly."""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
import urllib.request
import uuid
from typing import Any

import grpc
import pytest
import torch
from conftest import tiny_model
from torch import nn

from splitfed.channel.security.tokens import TokenIssuer
from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.client.remote import RemoteTrunk
from splitfed.channel.client.trunk import RetryPolicy, TrunkClient
from splitfed.channel.server.trunkserver import SERVICE_NAME, ChannelLimits, TrunkServer
from splitfed.errors import ChannelError, ResourceExhaustedError
from splitfed.split import CutState, split_model
from splitfed.trunk.aggregation.modes import Contribution, Outcome, SyncAggregator, make_aggregator
from splitfed.trunk.compute.runtime import TrunkRuntime
from splitfed.trunk.inference.sessions import SessionManager
from splitfed.trunk.compute.store import StoreLimits


def _step(client: TrunkClient, hidden: torch.Tensor, scale: float = 0.01):
    act = uuid.uuid4().hex
    out, _ = client.forward(CutState(hidden), activation_id=act, train=True)
    return client.backward(act, torch.ones_like(out) * scale)


def test_eighty_sync_clients_wait_without_holding_threads(trunk_server) -> None:
    """Sync barrier over 80 clients (more than the 64 threads a thread-per-call server had): every gradient applied,
    one step per round, no thread per waiter: every thread of the process is counted, whatever its name."""
    before = set(threading.enumerate())  # threads of earlier tests are not the server's
    split = split_model(tiny_model("llama", layers=2).train(), cuts=(1, 2))
    server = trunk_server(split.trunk, aggregator=make_aggregator("sync", timeout=120))
    n, steps = 80, 2
    joined = threading.Barrier(n)
    outcomes: list[str] = []
    errors: list[BaseException] = []
    peak: list[Any] = [0, []]
    stop = threading.Event()
    own: set[threading.Thread] = set()  # this test's: the monitor and the 80 clients

    def monitor() -> None:
        while not stop.wait(0.02):
            others = [t.name for t in threading.enumerate() if t not in before and t not in own]
            if len(others) > peak[0]:
                peak[:] = [len(others), others]

    def worker(i: int) -> None:
        try:
            client = TrunkClient(server.address, insecure=True, client_id=f"c{i}")
            client.join()
            joined.wait(120)  # the whole group is in before the first gradient
            for _ in range(steps):
                outcomes.append(_step(client, torch.randn(1, 3, 32)).outcome)
            client.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    watcher = threading.Thread(target=monitor, daemon=True)
    threads = [threading.Thread(target=worker, args=(i,), name=f"client-{i}") for i in range(n)]
    own.update([watcher, *threads])
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    stop.set()
    assert not errors, errors[:3]
    assert outcomes.count("APPLIED") == n * steps
    stats = server.runtime.aggregator.stats
    assert stats["steps"] == steps and stats["rejected-stale"] == 0 and stats["dropped-members"] == 0
    # The event loop, the device thread and grpc.aio's completion-queue poller (PollerCompletionQueue), however
    # many clients wait, and at most the event loop's default executor's bounded pool, where each client's
    # shared-memory region was opened (asyncio_N); a server that parks a thread per waiting client has about 80 more.
    pool = [name for name in peak[1] if name.startswith("asyncio_")]
    assert peak[0] - len(pool) <= 3 and len(pool) <= min(32, (os.cpu_count() or 1) + 4), peak


def test_a_member_that_joined_late_is_not_dropped_for_the_time_the_bucket_was_open() -> None:
    now = [0.0]
    agg = SyncAggregator(timeout=1.0, clock=lambda: now[0])
    updates: list = []
    agg.bind(updates.append)
    agg.join("a")
    agg.join("dead")
    first = agg.offer(Contribution("a", 0, [torch.tensor([1.0])]))
    now[0] = 0.9
    agg.join("late")
    now[0] = 1.2  # the bucket has been open for longer than the timeout, "late" joined 0.3 s ago
    agg.poll()
    assert not first.done() and agg.members == {"a", "late"} and agg.stats["dropped-members"] == 1
    assert agg.deadline() == pytest.approx(1.9)
    second = agg.offer(Contribution("late", 0, [torch.tensor([3.0])]))
    assert first.result(0).outcome is second.result(0).outcome is Outcome.APPLIED
    assert len(updates) == 1 and updates[0][0].item() == pytest.approx(2.0)


class _FailingSGD(torch.optim.SGD):
    """SGD whose next ``failures`` steps raise, as a device out of memory would."""

    failures = 0

    def step(self, closure=None):  # type: ignore[override]
        if self.failures:
            self.failures -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().step(closure)


def _round(server: TrunkServer, hiddens: list[torch.Tensor]) -> list[object]:
    """One sync step: every client forward + backward at once; returns each outcome or error. Each client joins the
    step group before any sends its gradient (the clients of an earlier round left it when they closed)."""
    results: list[object] = [None] * len(hiddens)
    joined = threading.Barrier(len(hiddens))

    def worker(i: int) -> None:
        client = TrunkClient(server.address, insecure=True, client_id=f"c{i}",
                             retry=RetryPolicy(max_attempts=2, initial_backoff_s=0.05))
        try:
            client.join()
            joined.wait(30)
            results[i] = _step(client, hiddens[i], scale=0.1).outcome
        except ChannelError as exc:
            results[i] = exc
        finally:
            client.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(hiddens))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def _sync_server(trunk_server, trunk: nn.Module, optimizer: torch.optim.Optimizer, members: int) -> TrunkServer:
    runtime = TrunkRuntime(trunk, optimizer, aggregator=make_aggregator("sync", timeout=30))
    for i in range(members):
        runtime.join(f"c{i}")
    return trunk_server(runtime)


def test_a_failed_step_fails_every_waiter_promptly_and_is_never_applied(trunk_server) -> None:
    torch.manual_seed(0)
    split = split_model(tiny_model("llama", layers=3).train(), cuts=(1, 2))
    reference = copy.deepcopy(split.trunk)
    optimizer = _FailingSGD(split.trunk.parameters(), lr=0.5)
    optimizer.failures = 1
    server = _sync_server(trunk_server, split.trunk, optimizer, 3)
    before = copy.deepcopy(split.trunk.state_dict())
    failed_inputs = [torch.randn(2, 4, 32) for _ in range(3)]
    start = time.monotonic()
    results = _round(server, failed_inputs)
    assert time.monotonic() - start < 20  # nobody waits out the 30 s timeout
    assert all(isinstance(r, ChannelError) and r.code == "INTERNAL" for r in results), results
    assert all("none of the 3 gradients" in str(r) for r in results)
    assert server.runtime.version == 0 and server.runtime.aggregator.stats["failed-steps"] == 1
    assert all(torch.equal(before[k], v) for k, v in split.trunk.state_dict().items())
    # The next step holds only its own gradients: same weights as a server that never saw the failed ones.
    inputs = [torch.randn(2, 4, 32) for _ in range(3)]
    assert _round(server, inputs) == ["APPLIED"] * 3
    ref_server = _sync_server(trunk_server, reference, torch.optim.SGD(reference.parameters(), lr=0.5), 3)
    assert _round(ref_server, inputs) == ["APPLIED"] * 3
    for (name, a), b in zip(split.trunk.state_dict().items(), reference.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_frozen_copies_and_remembered_answers_are_counted_and_bounded() -> None:
    split = split_model(tiny_model("llama", layers=3).train(), cuts=(1, 2))
    trainable = sum(p.numel() * p.element_size() for p in split.trunk.parameters())
    rt = TrunkRuntime(split.trunk, torch.optim.SGD(split.trunk.parameters(), lr=0.01),
                      aggregator=make_aggregator("async", max_staleness=100),
                      limits=StoreLimits(max_frozen=2, max_bytes=64 << 20))
    hidden = torch.randn(2, 4, 32)
    waiting = []
    for step in range(4):  # one pending forward per version, then a step from another client
        rt.forward("slow", f"s{step}", CutState(hidden), train=True)
        waiting.append(f"s{step}")
        out, _ = rt.forward("fast", f"f{step}", CutState(hidden), train=True)
        rt.backward("fast", f"f{step}", torch.ones_like(out))
    store = rt.store
    assert rt.version == 4 and store.frozen_copies == 2  # capped
    assert store.frozen_bytes == 2 * trainable
    assert [a for a in waiting if store.find(a) is not None] == ["s2", "s3"]  # the oldest were evicted
    assert store.bytes_held == store.forward_bytes + store.frozen_bytes + store.done_bytes
    assert store.done_bytes == 4 * hidden.numel() * 4  # the fast client's answers, kept for retries
    for a in ("s2", "s3"):  # finishing the stale forwards releases their copies
        rt.backward("slow", a, torch.ones(2, 4, 32))
    assert store.frozen_copies == 0 and store.frozen_bytes == 0 and store.forward_bytes == 0


def test_remembered_answers_give_way_to_the_budget() -> None:
    split = split_model(tiny_model("llama", layers=3).train(), cuts=(1, 2))
    hidden = torch.randn(4, 16, 32)
    probe = TrunkRuntime(split.trunk)
    probe.forward("c", "probe", CutState(hidden), train=True)
    one_forward, answer = probe.store.forward_bytes, hidden.numel() * 4
    budget = one_forward + answer // 2  # room for one forward, not for a forward and an answer
    rt = TrunkRuntime(split.trunk, torch.optim.SGD(split.trunk.parameters(), lr=0.01),
                      aggregator=make_aggregator("async"), limits=StoreLimits(max_bytes=budget))
    for i in range(4):
        try:
            out, _ = rt.forward("c", f"a{i}", CutState(hidden), train=True)
        except ResourceExhaustedError:
            pytest.fail("remembered answers must make room for new forwards")
        rt.backward("c", f"a{i}", torch.ones_like(out))
        assert rt.store.done_bytes == answer and rt.store.bytes_held <= budget


def _wide_input_server(trunk_server):
    """A trunk whose input (4096 wide) is far larger than its output (16 wide)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4096), nn.Linear(4096, 16), nn.Linear(16, 2))
    split = split_model(model, cuts=(1, 2))
    limits = ChannelLimits(max_message_bytes=256 << 10, stream_threshold_bytes=128 << 10, chunk_bytes=64 << 10)
    server = trunk_server(split.trunk, lr=0.1, limits=limits, aggregator=make_aggregator("async"))
    return split, server, limits


def test_a_reply_larger_than_the_request_is_checked_before_anything_is_applied(trunk_server) -> None:
    split, server, limits = _wide_input_server(trunk_server)
    client = TrunkClient(server.address, insecure=True, limits=limits)
    hidden = torch.randn(16, 4096)  # 256 KiB: over the unary threshold, so the forward streams
    act = uuid.uuid4().hex
    out, _ = client.forward(CutState(hidden), activation_id=act, train=True)
    with pytest.raises(ChannelError) as info:  # a unary backward whose reply could not be sent
        client.backward(act, torch.ones_like(out))
    assert info.value.code == "RESOURCE_EXHAUSTED" and "nothing was applied" in str(info.value)
    assert server.runtime.version == 0 and server.runtime.store.find(act) is not None
    reply = client.backward(act, torch.ones_like(out), input_numel=hidden.numel())  # the client sizes the reply
    assert reply.outcome == "APPLIED" and server.runtime.version == 1 and reply.grad.shape == hidden.shape
    # RemoteTrunk does that by itself.
    remote = RemoteTrunk(client)
    bottom_out = split.bottom(torch.randn(16, 8))
    loss = split.top(remote(bottom_out)).sum()
    loss.backward()
    assert server.runtime.version == 2


def test_identity_is_checked_before_a_streamed_payload_is_read(trunk_server) -> None:
    issuer = TokenIssuer("run")
    split = split_model(tiny_model("llama", layers=2).train(), cuts=(1, 2))
    server = trunk_server(split.trunk, authenticate=issuer.authenticate)
    release = threading.Event()
    header = pb.Frame(forward_request=pb.ForwardRequest(
        activation_id="x", train=True, tensors=[pb.Tensor(name="hidden", dtype=1, shape=[64, 512, 32])]))

    def frames():
        yield header
        release.wait(20)  # the payload would follow; the server must not wait for it

    with grpc.insecure_channel(server.address) as channel:
        call = channel.stream_stream(f"/{SERVICE_NAME}/ForwardStream", request_serializer=pb.Frame.SerializeToString,
                                     response_deserializer=pb.Frame.FromString)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            list(call(frames(), timeout=15))
        elapsed = time.monotonic() - start
    release.set()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert elapsed < 10


def test_a_cancelled_call_is_counted_as_cancelled_quietly(trunk_server, caplog) -> None:
    split = split_model(tiny_model("llama", layers=2).train(), cuts=(1, 2))
    server = trunk_server(split.trunk, aggregator=make_aggregator("sync", timeout=60), metrics_port=0)
    server.runtime.join("other")  # the barrier will wait for it
    client = TrunkClient(server.address, insecure=True, client_id="impatient",
                         retry=RetryPolicy(timeout_s=0.5, max_attempts=2))
    act = uuid.uuid4().hex
    out, _ = client.forward(CutState(torch.randn(1, 3, 32)), activation_id=act, train=True)
    caplog.set_level(logging.INFO)
    with pytest.raises(ChannelError) as info:
        client.backward(act, torch.ones_like(out))
    assert info.value.code == "DEADLINE_EXCEEDED"
    deadline = time.monotonic() + 5
    body = ""
    while 'code="CANCELLED"' not in body and time.monotonic() < deadline:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()
        time.sleep(0.1)
    assert 'splitfed_rpc_total{code="CANCELLED",method="Backward",model=""} 1.0' in body
    assert 'code="INTERNAL"' not in body
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("splitfed")]


def _session_trunk() -> SessionManager:
    split = split_model(tiny_model("llama", layers=3), cuts=(1, 2))
    return SessionManager(TrunkRuntime(split.trunk), max_sessions_per_client=2)


def test_a_retried_session_step_without_a_mask_extends_the_cache_once() -> None:
    sessions = _session_trunk()
    sid, _ = sessions.open("c", max_length=16)
    first = sessions.step("c", sid, CutState(torch.randn(1, 4, 32)), step_id="s1")
    again = sessions.step("c", sid, CutState(torch.randn(1, 4, 32)), step_id="s1")  # the lost reply's retry
    assert torch.equal(first, again)
    session = sessions._sessions[sid]
    assert session.length == 4 and session.cache.get_seq_length() == 4
    sessions.step("c", sid, CutState(torch.randn(1, 1, 32)), step_id="s2")
    assert session.length == 5 and session.cache.get_seq_length() == 5


def test_one_client_cannot_take_every_session() -> None:
    sessions = _session_trunk()
    sessions.open("greedy", max_length=8)
    sessions.open("greedy", max_length=8)
    with pytest.raises(ResourceExhaustedError, match="most one client may"):
        sessions.open("greedy", max_length=8)
    sessions.open("other", max_length=8)


def test_small_tasks_run_inline_only_when_the_device_thread_is_idle() -> None:
    """A small task skips the device thread when it is idle; while the device thread works, it queues behind."""
    from splitfed.trunk.scheduler import TrunkScheduler

    split = split_model(tiny_model("llama", layers=3), cuts=(1, 2))
    scheduler = TrunkScheduler(TrunkRuntime(split.trunk)).start()
    try:
        caller = threading.get_ident()
        done = scheduler.now_or_queued(threading.get_ident, small=True)
        assert done.done() and done.result() == caller and scheduler.stats["inline"] == 1
        assert scheduler.now_or_queued(threading.get_ident, small=False).result(5) != caller  # large: queued

        running, release, order = threading.Event(), threading.Event(), []

        def slow() -> None:
            running.set()
            release.wait(5)
            order.append("slow")

        scheduler.call(slow)
        assert running.wait(5)
        queued = scheduler.now_or_queued(lambda: order.append("small") or threading.get_ident(), small=True)
        assert not queued.done()  # the device thread is busy: no second task runs at once
        release.set()
        assert queued.result(5) != caller and order == ["slow", "small"]
        assert scheduler.stats["inline"] == 1
    finally:
        scheduler.stop()


def test_a_waiter_that_gives_up_cancels_nothing_and_the_device_thread_lives_on() -> None:
    """An asyncio call cancelled while it awaits trunk work (its client went away) stops waiting only: the work's
    future is not cancelled, so the device thread that resolves it does not fail, and later work runs."""
    import asyncio

    from splitfed.trunk.scheduler import TrunkScheduler

    scheduler = TrunkScheduler(TrunkRuntime(split_model(tiny_model("llama").train(), cuts=(1, 3)).trunk)).start()
    try:
        gate = threading.Event()
        scheduler.call(lambda: gate.wait(10))  # keeps the device thread busy
        queued = scheduler.call(lambda: 42)

        async def give_up() -> None:
            waiting = asyncio.ensure_future(asyncio.wrap_future(queued))
            await asyncio.sleep(0.05)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting

        asyncio.run(give_up())
        assert not queued.cancelled()
        gate.set()
        assert queued.result(10) == 42
        assert scheduler.call(lambda: 7).result(10) == 7  # the device thread is alive
    finally:
        scheduler.stop()
