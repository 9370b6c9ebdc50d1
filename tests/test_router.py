"""The router in front of several trunk servers: sticky per client, new clients by load (and memory), only backends
that hold the model, failover when a backend dies, metadata, deadlines and cancellation passed through, backend
errors passed through, shared-memory regions, and split generation through it."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch
from conftest import batch_for, tiny_cnn, tiny_model
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.client.trunk import RetryPolicy, TrunkClient
from splitfed.channel.wire.limits import CLIENT_ID_KEY, MODEL_KEY, SERVICE_NAME
from splitfed.channel.routing import Router
from splitfed.channel.server.trunkserver import TrunkServer
from splitfed.errors import ChannelError
from splitfed.client.generation import generate
from splitfed.models.catalog import mnist_cnn
from splitfed.split import CutState, split_model
from splitfed.trunk.aggregation.modes import make_aggregator

NO_RETRY = RetryPolicy(retryable_codes=("DATA_LOSS",), timeout_s=60.0)  # UNAVAILABLE reaches the caller


def _cnn_trunk(seed: int = 0) -> torch.nn.Module:
    return split_model(tiny_cnn(seed), cuts=(3, 6)).trunk


def _act(client: TrunkClient, train: bool = True) -> tuple[str, torch.Tensor]:
    act = uuid.uuid4().hex
    out, _ = client.forward(CutState(torch.randn(2, 4, 14, 14)), activation_id=act, train=train)
    return act, out


def _wait(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def _serving(address: str) -> bool:
    """Whether the split channel's service at ``address`` is SERVING (its model loaded)."""
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                                          timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def started() -> Iterator[Callable[..., Any]]:
    """Start servers and routers; all stopped after the test (routers first)."""
    items: list[Any] = []

    def start(thing: Any) -> Any:
        items.append(thing.start())
        return thing

    yield start
    for thing in reversed(items):
        thing.stop(grace=0)


def _servers(started: Callable[..., Any], n: int, **kwargs: Any) -> list[TrunkServer]:
    kwargs.setdefault("insecure", True)
    kwargs.setdefault("model_name", "cnn")
    return [started(TrunkServer(_cnn_trunk(), **kwargs)) for _ in range(n)]


def _router(started: Callable[..., Any], servers: list[Any], **kwargs: Any) -> Router:
    kwargs.setdefault("insecure", True)
    kwargs.setdefault("probe_interval_s", 0.2)
    return started(Router([s.address for s in servers], **kwargs))


# -- stickiness ----------------------------------------------------------------------------------------
def test_each_client_stays_on_its_backend_and_new_clients_spread(started: Callable[..., Any]) -> None:
    # Prepare: two async backends (a step per backward), four clients through one router
    servers = [started(TrunkServer(_cnn_trunk(), insecure=True, aggregator=make_aggregator("async")))
               for _ in range(2)]
    router = _router(started, servers)
    clients = [TrunkClient(router.address, insecure=True, client_id=f"c{i}", shared_memory="off")
               for i in range(4)]  # no region held, which would keep its pin
    # Execute: every client's forwards and backwards in turn, several rounds
    homes: dict[str, set[str]] = {c.client_id: set() for c in clients}
    for _ in range(3):
        for c in clients:
            act, out = _act(c)
            homes[c.client_id].add(str(router.backend_of(c.client_id)))
            assert c.backward(act, torch.ones_like(out)).outcome == "APPLIED"  # found its forward
    # Assert: a client's forward and backward always met, on one backend; each backend took two clients' steps
    assert all(len(h) == 1 for h in homes.values()), homes
    steps = {s.address: s.runtime.version for s in servers}
    assert sorted(steps.values()) == [6, 6], steps
    # leaving the step group (no session or region held) ends a client's pin: its next call is placed by load
    for c in clients:
        c.leave()
        assert router.backend_of(c.client_id) is None
        c.close()
    assert [s["pinned"] for s in router.stats()] == [0, 0]


def test_a_backward_follows_its_forward_when_the_loads_change(started: Callable[..., Any]) -> None:
    # Prepare: c0's forward lands on backend 0; then backend 0 gets busier than backend 1
    servers = [started(TrunkServer(_cnn_trunk(), insecure=True, aggregator=make_aggregator("async")))
               for _ in range(2)]
    router = _router(started, servers)
    c0, c1, c2 = (TrunkClient(router.address, insecure=True, client_id=f"c{i}", retry=NO_RETRY) for i in range(3))
    act, out = _act(c0)
    c1.info()  # backend 1
    c2.info()  # backend 0 (a tie goes to the first)
    c1.leave()  # backend 1 has no client now
    assert [s["pinned"] for s in router.stats()] == [2, 0]
    # Execute
    reply = c0.backward(act, torch.ones_like(out))
    # Assert: c0's backward met its forward on backend 0 although backend 1 is idle
    assert reply.outcome == "APPLIED" and servers[0].runtime.version == 1 and servers[1].runtime.version == 0
    for c in (c0, c1, c2):
        c.close()


def test_pins_last_while_a_session_is_open_and_end_at_leave(started: Callable[..., Any]) -> None:
    # Prepare: a tiny Llama trunk on two backends
    model = tiny_model("llama").eval()
    parts = split_model(tiny_model("llama").eval(), (1, 3))
    servers = [started(TrunkServer(split_model(tiny_model("llama"), (1, 3)).trunk, insecure=True, model_name="llama"))
               for _ in range(2)]
    router = _router(started, servers)
    ids, mask, _ = batch_for("llama", batch=1, length=6)
    want = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8,
                          pad_token_id=0, eos_token_id=None)
    # Execute: split generation through the router (an inference session: open, steps, close)
    with TrunkClient(router.address, insecure=True, client_id="gen") as client:
        got = generate(parts.bottom, client, parts.top, ids, mask, max_new_tokens=8)
        home = router.backend_of("gen")
    # Assert: token for token the unsplit model's greedy output; every step on the backend that held the session
    assert torch.equal(got, want)
    steps = {s.address: s.servicer.sessions.stats["steps"] for s in servers}
    assert steps[home] == 8 and sum(steps.values()) == 8, steps


# -- balance by load -------------------------------------------------------------------------------------
def test_new_clients_go_to_the_least_loaded_backend(started: Callable[..., Any]) -> None:
    # Prepare: two sync backends; six idle clients spread three and three
    servers = _servers(started, 2)
    router = _router(started, servers)
    clients = [TrunkClient(router.address, insecure=True, client_id=f"c{i}", retry=NO_RETRY, shared_memory="off")
               for i in range(6)]  # no region: every call goes through the router (none over a direct link)
    for c in clients:
        c.info()
    on = {s.address: [c for c in clients if router.backend_of(c.client_id) == s.address] for s in servers}
    assert [len(v) for v in on.values()] == [3, 3]
    a, b = (s.address for s in servers)
    # Execute: on backend a, three clients join its step group and two send their gradient, which waits for the
    # third: two calls in flight there
    group = on[a]
    for c in group:
        c.join()
    acts = [_act(c) for c in group]
    waiting = [threading.Thread(target=c.backward, args=(act, torch.ones_like(out)))
               for c, (act, out) in zip(group[:2], acts[:2])]
    for t in waiting:
        t.start()
    _wait(lambda: router.stats()[0]["in_flight"] == 2)
    newcomer = TrunkClient(router.address, insecure=True, client_id="new", shared_memory="off")
    newcomer.info()
    # Assert: the newcomer goes to b (load 3 against 5), where it would have gone to a (lower index) on a tie
    assert router.backend_of("new") == b
    stats = router.stats()
    assert (stats[0]["pinned"], stats[0]["in_flight"], stats[1]["pinned"]) == (3, 2, 4)
    # the step completes once the third member sends its gradient
    clients_a3, (act, out) = group[2], acts[2]
    assert clients_a3.backward(act, torch.ones_like(out)).trunk_version == 1
    for t in waiting:
        t.join(30)
    _wait(lambda: router.stats()[0]["in_flight"] == 0)
    for c in clients + [newcomer]:
        c.close()


def test_ties_go_to_the_backend_whose_trunk_holds_fewer_bytes(started: Callable[..., Any]) -> None:
    # Prepare: two backends that export metrics; a client connected to the first directly keeps a saved forward
    servers = _servers(started, 2, metrics_port=0)
    direct = TrunkClient(servers[0].address, insecure=True, client_id="direct")
    _act(direct)
    router = _router(started, servers, metrics={s.address: f"http://127.0.0.1:{s.metrics_port}/metrics"
                                                for s in servers})
    # Execute
    _wait(lambda: (router.stats()[0]["held_bytes"] or 0) > 0)
    client = TrunkClient(router.address, insecure=True, client_id="newcomer")
    client.info()
    # Assert: equal load (nothing pinned, nothing in flight): the backend holding no saved forward takes it
    assert router.stats()[1]["held_bytes"] == 0
    assert router.backend_of("newcomer") == servers[1].address
    client.close()
    direct.close()


# -- models -------------------------------------------------------------------------------------------
def test_calls_go_to_a_backend_that_holds_their_model(started: Callable[..., Any]) -> None:
    # Prepare: m1 on backends 0 and 2, m2 on backend 1
    servers = [started(TrunkServer(_cnn_trunk(), insecure=True, model_name=name)) for name in ("m1", "m2", "m1")]
    router = _router(started, servers)
    # Execute
    m2 = [TrunkClient(router.address, insecure=True, client_id=f"two-{i}", model="m2") for i in range(3)]
    m1 = [TrunkClient(router.address, insecure=True, client_id=f"one-{i}", model="m1") for i in range(4)]
    models = [c.info().model for c in m2 + m1]
    # Assert: each on a backend of its model, m1's clients spread over both of its backends
    assert models == ["m2"] * 3 + ["m1"] * 4
    assert {router.backend_of(c.client_id, "m2") for c in m2} == {servers[1].address}
    assert sorted(str(router.backend_of(c.client_id, "m1")) for c in m1) == \
        sorted([servers[0].address] * 2 + [servers[2].address] * 2)
    # a model no backend holds: NOT_FOUND naming the models they hold; nothing pinned
    unknown = TrunkClient(router.address, insecure=True, client_id="lost", model="m3")
    with pytest.raises(ChannelError) as err:
        unknown.info()
    assert err.value.code == "NOT_FOUND" and "'m1', 'm2'" in str(err.value) and MODEL_KEY in str(err.value)
    assert router.backend_of("lost", "m3") is None
    # the router's health names each model it can serve
    with grpc.insecure_channel(router.address) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        assert check(health_pb2.HealthCheckRequest(service=f"{SERVICE_NAME}/m2")).status == \
            health_pb2.HealthCheckResponse.SERVING
    for c in m1 + m2 + [unknown]:
        c.close()


# -- failover ------------------------------------------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dead_backend_fails_its_calls_unavailable_and_its_clients_move(started: Callable[..., Any]) -> None:
    # Prepare: backend a is a process of its own (killed below), b is in this process
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "splitfed.cli", "serve", "--model", "mnist-cnn", "--cuts", "3,6",
                             "--port", str(port), "--insecure"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        TrunkClient(f"127.0.0.1:{port}", insecure=True).wait_ready(120)
        _wait(lambda: _serving(f"127.0.0.1:{port}"), 120)  # listening comes before the model is loaded
        b = started(TrunkServer(split_model(mnist_cnn(), (3, 6)).trunk, insecure=True, model_name="mnist-cnn"))
        router = started(Router([f"127.0.0.1:{port}", b.address], insecure=True, probe_interval_s=30.0))
        x = TrunkClient(router.address, insecure=True, client_id="x", retry=NO_RETRY, shared_memory="off")
        act = uuid.uuid4().hex
        out, _ = x.forward(CutState(torch.randn(2, 32, 14, 14)), activation_id=act, train=True)
        assert router.backend_of("x") == f"127.0.0.1:{port}"
        # a second member of a's step group, connected directly, never sends its gradient: x's backward waits
        other = TrunkClient(f"127.0.0.1:{port}", insecure=True, client_id="other")
        other.join()
        x.join()
        failure: list[BaseException] = []

        def backward() -> None:
            try:
                x.backward(act, torch.ones_like(out))
            except BaseException as exc:  # noqa: BLE001 - asserted below
                failure.append(exc)

        waiting = threading.Thread(target=backward)
        waiting.start()
        _wait(lambda: router.stats()[0]["in_flight"] == 1)
        # Execute: backend a dies with x's backward in flight
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        waiting.join(30)
        # Assert: the call in flight failed UNAVAILABLE; a is marked down at once (no periodic probe yet) and x's
        # next call, and a new client's, go to b
        assert len(failure) == 1 and isinstance(failure[0], ChannelError) and failure[0].code == "UNAVAILABLE"
        _wait(lambda: not router.stats()[0]["live"], 10)
        out2, _ = x.forward(CutState(torch.randn(2, 32, 14, 14)), activation_id=uuid.uuid4().hex, train=False)
        assert out2.shape == (2, 64, 7, 7) and router.backend_of("x") == b.address
        newcomer = TrunkClient(router.address, insecure=True, client_id="new")
        assert newcomer.info().model == "mnist-cnn" and router.backend_of("new") == b.address
        with grpc.insecure_channel(router.address) as channel:  # the router still serves: b lives
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        for c in (x, other, newcomer):
            c.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def test_no_live_backend_is_unavailable(started: Callable[..., Any]) -> None:
    router = started(Router([f"127.0.0.1:{_free_port()}"], insecure=True, probe_interval_s=0.2))
    client = TrunkClient(router.address, insecure=True, retry=NO_RETRY)
    with pytest.raises(ChannelError) as err:
        client.info()
    assert err.value.code == "UNAVAILABLE" and "no trunk server behind this router is reachable" in str(err.value)
    with grpc.insecure_channel(router.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    client.close()


# -- what passes through ---------------------------------------------------------------------------------
class _Recorder:
    """A split-channel backend that records what reaches it: metadata, deadline, cancellation."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.fail_next = False  # answer the next Info UNAVAILABLE
        self.cancelled = threading.Event()
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _info(self, request: bytes, context: Any) -> bytes:
        self.seen.append({"metadata": dict(context.invocation_metadata()), "remaining": context.time_remaining(),
                          "request": request})
        if self.fail_next and CLIENT_ID_KEY in self.seen[-1]["metadata"]:
            self.fail_next = False
            await context.abort(grpc.StatusCode.UNAVAILABLE, "try again")
        return pb.InfoReply(model="rec").SerializeToString()

    async def _join(self, request: bytes, context: Any) -> bytes:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return b""

    def start(self) -> _Recorder:
        self._thread.start()

        async def run() -> None:
            self.server = grpc.aio.server()
            self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {
                "Info": grpc.unary_unary_rpc_method_handler(self._info),
                "Join": grpc.unary_unary_rpc_method_handler(self._join)}),))
            servicer = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(servicer, self.server)
            self.port = self.server.add_insecure_port("127.0.0.1:0")
            await self.server.start()
            await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)
        return self

    def stop(self, grace: float | None = 0) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(grace), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)


def test_metadata_deadline_and_cancellation_pass_through(started: Callable[..., Any]) -> None:
    # Prepare
    backend = started(_Recorder())
    router = _router(started, [backend])
    with grpc.insecure_channel(router.address) as channel:
        info = channel.unary_unary(f"/{SERVICE_NAME}/Info")
        join = channel.unary_unary(f"/{SERVICE_NAME}/Join")
        md = ((CLIENT_ID_KEY, "c1"), ("authorization", "Bearer t0k"), ("x-custom", "v"), ("x-blob-bin", b"\x00\x01"))
        # Execute: a call with metadata and a 5 s deadline; then a call the client cancels while the backend works
        reply = info(b"\x08\x01", metadata=md, timeout=5.0)
        future = join.future(b"", metadata=md, timeout=30.0)
        time.sleep(0.5)
        future.cancel()
        # Assert: the request's bytes, its metadata (less gRPC's own) and its deadline reached the backend ...
        assert pb.InfoReply.FromString(reply).model == "rec"
        seen = backend.seen[-1]
        assert seen["request"] == b"\x08\x01"
        assert {k: seen["metadata"][k] for k in (CLIENT_ID_KEY, "authorization", "x-custom", "x-blob-bin")} == \
            {CLIENT_ID_KEY: "c1", "authorization": "Bearer t0k", "x-custom": "v", "x-blob-bin": b"\x00\x01"}
        # (gRPC's timeout header rounds up: to 10 ms units between 1 s and 10 s, at each of the two hops)
        assert 3.0 < seen["remaining"] <= 5.0 + 0.05
        # ... and the client's cancellation cancelled the backend's call
        assert backend.cancelled.wait(10)
        _wait(lambda: router.stats()[0]["in_flight"] == 0)


def test_a_retried_call_reaches_the_backend_marked_as_a_retry(started: Callable[..., Any]) -> None:
    # Prepare: the backend answers the first attempt UNAVAILABLE; the client's gRPC retries it (its retry policy)
    backend = started(_Recorder())
    router = _router(started, [backend])
    client = TrunkClient(router.address, insecure=True, client_id="c1")
    backend.fail_next = True
    # Execute
    assert client.info().model == "rec"
    # Assert: the retry reached the backend with x-splitfed-retry (one of the retry keys its servicer reads; gRPC's
    # own grpc-previous-rpc-attempts is reserved), the first attempt without it
    attempts = [seen["metadata"] for seen in backend.seen if seen["metadata"].get(CLIENT_ID_KEY) == "c1"]
    assert [a.get("x-splitfed-retry") for a in attempts] == [None, "1"]
    client.close()


def test_backend_errors_and_tokens_pass_through_and_the_router_keeps_serving(started: Callable[..., Any]) -> None:
    from splitfed.channel.security.tokens import TokenIssuer

    # Prepare: a backend that requires tokens
    tokens = TokenIssuer("run")
    server = started(TrunkServer(_cnn_trunk(), insecure=True, authenticate=tokens.authenticate, model_name="cnn"))
    router = _router(started, [server])
    good = TrunkClient(router.address, insecure=True, token=tokens.issue(1, 1), retry=NO_RETRY)
    bad = TrunkClient(router.address, insecure=True, token="not-a-token", retry=NO_RETRY)
    direct = TrunkClient(server.address, insecure=True, token=tokens.issue(2, 1), retry=NO_RETRY)
    errors = {}
    for name, client in (("router", good), ("direct", direct)):
        # an unknown activation: the backend's NOT_FOUND, its message unchanged
        with pytest.raises(ChannelError) as err:
            client.backward("no-such-activation", torch.ones(2, 8, 7, 7))
        errors[name] = (err.value.code, str(err.value).split("failed with ", 1)[1])
    assert errors["router"] == errors["direct"] and errors["router"][0] == "NOT_FOUND", errors
    with pytest.raises(ChannelError) as err:
        bad.join()
    assert err.value.code == "UNAUTHENTICATED"
    # bytes that do not parse: the backend's INVALID_ARGUMENT
    with grpc.insecure_channel(router.address) as channel, pytest.raises(grpc.RpcError) as raw:
        channel.unary_unary(f"/{SERVICE_NAME}/Forward")(b"\xff\xff\xff", timeout=10,
                                                         metadata=(("authorization", "Bearer " +
                                                                    tokens.issue(3, 1)),))
    assert raw.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    # Assert: the router still serves, and the token's client trains through it
    act, out = _act(good)
    assert good.backward(act, torch.ones_like(out)).outcome == "APPLIED"
    for c in (good, bad, direct):
        c.close()


# -- shared memory ---------------------------------------------------------------------------------------
def test_shared_memory_regions_open_on_the_clients_backend(started: Callable[..., Any], monkeypatch) -> None:
    from splitfed.channel.transports.shm import lane as shared

    monkeypatch.setattr(shared, "MIN_REGION_TENSOR_BYTES", 1)  # the tiny CNN's activations are small
    # Prepare: two backends; the client's tensors cross the cut through a region
    servers = _servers(started, 2)
    router = _router(started, servers)
    first = TrunkClient(router.address, insecure=True, client_id="first")
    first.info()  # takes backend 0: ours goes to 1
    client = TrunkClient(router.address, insecure=True, client_id="shm", shared_memory="on")
    # Execute: three training steps through the router; after the first, both clients leave the step group
    outcomes = []
    for step in range(3):
        act, out = _act(client)
        outcomes.append(client.backward(act, torch.ones_like(out)).outcome)
        if step == 0:  # the round ends for both: "shm" keeps its backend, where its region is
            first.leave()
            client.leave()
    # Assert: every tensor went through the region, which backend 1 (the client's) opened
    assert outcomes == ["APPLIED"] * 3 and client.shared.calls == 6
    assert router.backend_of("shm") == servers[1].address
    assert servers[1].runtime.version == 3 and servers[0].runtime.version == 0
    assert servers[1].servicer.regions.total_bytes > 0 and servers[0].servicer.regions.total_bytes == 0
    client.close()
    _wait(lambda: servers[1].servicer.regions.total_bytes == 0)  # CloseRegion reached it too
    first.close()
