"""The split channel on loopback: large tensors, health, reflection, and the catalogue of bad inputs.

Every bad request gets a precise status (never UNKNOWN or INTERNAL), the server
stays SERVING, and the trunk's weights and optimizer state do not change.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch
from conftest import batch_for, tiny_model
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.client.remote import RemoteTrunk
from splitfed.channel.client.trunk import TrunkClient
from splitfed.channel.transports.shm.regions import SharedRegion
from splitfed.channel.wire.split_channel_pb2_grpc import SplitChannelStub
from splitfed.channel.server.trunkserver import CLIENT_ID_KEY, SERVICE_NAME, ChannelLimits
from splitfed.channel.wire.messages import encode_state, to_proto
from splitfed.codec.tensors import encode
from splitfed.errors import ChannelError
from splitfed.split import CutState, split_model
from splitfed.trunk.aggregation.modes import make_aggregator
from splitfed.trunk.aggregation.percopy import PerClientAggregator
from splitfed.trunk.compute.store import StoreLimits

C = grpc.StatusCode
HIDDEN = 32


def _tensor(name: str, t: torch.Tensor, **override: object) -> pb.Tensor:
    msg = to_proto(encode(name, t))
    for key, value in override.items():
        if key == "shape":
            del msg.shape[:]
            msg.shape.extend(value)  # type: ignore[arg-type]
        else:
            setattr(msg, key, value)
    return msg


def _hidden(b: int = 2, t: int = 5) -> torch.Tensor:
    return torch.randn(b, t, HIDDEN)


@pytest.fixture(params=["async", "sync", "quorum", "per-client", "sequential"])
def served(trunk_server, request):
    """A llama trunk served with small limits in each trunk mode; yields (server, stub, call)."""
    split = split_model(tiny_model("llama").train(), cuts=(1, 3))
    limits = ChannelLimits(max_message_bytes=1 << 20, stream_threshold_bytes=512 << 10, chunk_bytes=64 << 10,
                           max_tensor_bytes=8 << 20)
    # In every mode, a client whose request was refused must not hold up the healthy client's step
    # (the timeout is long, so waiting for it would show).
    aggregator = make_aggregator(request.param, quorum=2, max_staleness=4, timeout=30)
    server = trunk_server(split.trunk, optimizer="adamw", lr=0.01, limits=limits, aggregator=aggregator,
                          store_limits=StoreLimits(ttl_s=0.5, max_per_client=4))
    channel = grpc.insecure_channel(server.address, options=limits.grpc_options())
    stub = SplitChannelStub(channel)
    stub.channel = channel

    def call(method: str, request: object, client: str = "alice") -> object:
        return getattr(stub, method)(request, metadata=[(CLIENT_ID_KEY, client)], timeout=20)

    yield server, stub, call, channel
    channel.close()


def _fwd(act: str | None = None, train: bool = True, tensors: list[pb.Tensor] | None = None) -> pb.ForwardRequest:
    return pb.ForwardRequest(activation_id=act or uuid.uuid4().hex, train=train, num_examples=2,
                             tensors=tensors if tensors is not None else [_tensor("hidden", _hidden())])


def _bwd(act: str, grad: torch.Tensor | None = None, **override: object) -> pb.BackwardRequest:
    return pb.BackwardRequest(activation_id=act, tensors=[_tensor("grad", grad if grad is not None else
                                                                  torch.randn(2, 5, HIDDEN), **override)])


def _frames(header: pb.ForwardRequest, chunks: list[tuple[int, bytes]]) -> Iterator[pb.Frame]:
    yield pb.Frame(forward_request=header)
    for offset, data in chunks:
        yield pb.Frame(chunk=pb.Chunk(offset=offset, data=data))


def _stream_header(shape: list[int]) -> pb.ForwardRequest:
    return pb.ForwardRequest(activation_id=uuid.uuid4().hex, train=True,
                             tensors=[pb.Tensor(name="hidden", dtype=pb.FLOAT32, shape=shape)])


def _copies(server) -> dict[str, tuple[list[torch.Tensor], dict, int, int]]:
    """Per-client (V1) mode: each client's trunk copy (weights, optimizer state, steps, examples), where its
    gradients go; {} in the other modes."""
    agg = server.runtime.aggregator
    if not isinstance(agg, PerClientAggregator):
        return {}
    with agg._lock:
        return {cid: ([p.detach().clone() for p in c.params], copy.deepcopy(c.optimizer.state_dict()), c.steps,
                      c.num_examples) for cid, c in agg._copies.items()}


def _trunk_snapshot(server) -> tuple[dict, dict, int, dict]:
    rt = server.runtime
    return copy.deepcopy(rt.trunk.state_dict()), copy.deepcopy(rt.optimizer.state_dict()), rt.version, _copies(server)


def _assert_same_optimizer_state(before: dict, now: dict) -> None:
    assert now["state"].keys() == before["state"].keys()
    for key, value in before["state"].items():
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(now["state"][key][n])) for n, v in value.items())


def _assert_unchanged(server, snap) -> None:
    """Nothing a gradient changes has changed: the global trunk, its optimizer and version, and in per-client mode
    every client's copy (a copy made since is the global trunk's weights, untrained)."""
    weights, opt, version, copies = snap
    now = server.runtime.trunk.state_dict()
    assert all(torch.equal(weights[k], now[k]) for k in weights)
    _assert_same_optimizer_state(opt, server.runtime.optimizer.state_dict())
    assert server.runtime.version == version
    trainable = [p.detach() for p in server.runtime.trunk.parameters() if p.requires_grad]
    for cid, (params, opt_state, steps, examples) in _copies(server).items():
        if cid in copies:
            before, opt_before, steps_before, examples_before = copies[cid]
            assert (steps, examples) == (steps_before, examples_before), cid
            assert all(torch.equal(a, b) for a, b in zip(before, params)), cid
            _assert_same_optimizer_state(opt_before, opt_state)
        else:
            assert steps == 0 and not opt_state["state"], cid
            assert all(torch.equal(a, b) for a, b in zip(trainable, params)), cid


class _Marker:
    """Lets a case whose set-up legitimately trains say where the bad request starts."""

    hook: Callable[[], None] = staticmethod(lambda: None)


def _mark() -> None:
    _Marker.hook()


def _serving(channel: grpc.Channel) -> bool:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


# (id, expected status, message fragment, action(call, stub) -> None)
Case = tuple[str, grpc.StatusCode, str, Callable[..., object]]


def _dup(call, stub):
    act = uuid.uuid4().hex
    call("Forward", _fwd(act))
    call("Forward", _fwd(act))


def _twice(call, stub):
    act = uuid.uuid4().hex
    call("Forward", _fwd(act, train=True))
    call("Backward", _bwd(act))
    _mark()
    call("Backward", _bwd(act))


def _foreign(call, stub):
    act = uuid.uuid4().hex
    call("Forward", _fwd(act), client="alice")
    call("Backward", _bwd(act), client="mallory")


def _eval_then_backward(call, stub):
    act = uuid.uuid4().hex
    call("Forward", _fwd(act, train=False))
    call("Backward", _bwd(act))


def _expired(call, stub):
    act = uuid.uuid4().hex
    call("Forward", _fwd(act))
    time.sleep(1.2)
    call("Backward", _bwd(act))


def _per_client_cap(call, stub):
    for _ in range(40):  # 4 allowed; more tries in case a loaded machine lets the first ones expire (0.5 s TTL)
        call("Forward", _fwd(), client="hoarder")


def _grad_shape(call, stub):
    act = uuid.uuid4().hex
    call("Forward", _fwd(act))
    call("Backward", _bwd(act, torch.randn(2, 4, HIDDEN)))


def _grad_nan(call, stub):
    act = uuid.uuid4().hex
    call("Forward", _fwd(act))
    call("Backward", _bwd(act, torch.full((2, 5, HIDDEN), float("inf"))))


def _step_fields(step_id: str, parts: int):
    def run(call, stub):
        act = uuid.uuid4().hex
        call("Forward", _fwd(act))
        req = _bwd(act)
        req.step_id, req.step_parts = step_id, parts
        call("Backward", req)
    return run


def _step_parts_change(call, stub):
    first, second = uuid.uuid4().hex, uuid.uuid4().hex
    call("Forward", _fwd(first))
    req = _bwd(first)
    req.step_id, req.step_parts = "step", 2
    assert call("Backward", req).outcome == pb.UPDATE_OUTCOME_UNSPECIFIED  # a part: answered at once
    call("Forward", _fwd(second))  # after the first part: the catalogue's saved forwards live 0.5 s
    _mark()
    req = _bwd(second)
    req.step_id, req.step_parts = "step", 3
    call("Backward", req)


def _stream(stub, header, chunks):
    list(stub.ForwardStream(_frames(header, chunks), metadata=[(CLIENT_ID_KEY, "alice")], timeout=20))


def _raw(channel_method: str, payload: bytes):
    def run(call, stub):
        channel = stub.channel
        fn = channel.unary_unary(f"/{SERVICE_NAME}/{channel_method}", request_serializer=None,
                                 response_deserializer=None)
        fn(payload, timeout=10)
    return run


def _region_tensor(call, t: torch.Tensor, client: str = "alice", name: str = "hidden", **slice_override: object
                   ) -> pb.Tensor:
    """``t`` written into a region ``client`` opened; the tensor message names it (fields overridable)."""
    reply = call("OpenRegion", pb.OpenRegionRequest(nbytes=1 << 20), client=client)
    data = t.contiguous().view(torch.uint8).reshape(-1)
    mapping = SharedRegion.attach(reply.region, reply.nbytes)
    mapping.view(0, data.numel()).copy_(data)
    mapping.close()
    ref = pb.RegionSlice(region=reply.region, offset=0, nbytes=data.numel())
    for key, value in slice_override.items():
        setattr(ref, key, value)
    return pb.Tensor(name=name, dtype=pb.FLOAT32, shape=list(t.shape), region=ref)


def _region_case(make: Callable[..., pb.Tensor]):
    def run(call, stub):
        call("Forward", _fwd(tensors=[make(call)]))
    return run


def _with(msg: pb.Tensor, **fields: object) -> pb.Tensor:
    for key, value in fields.items():
        if isinstance(value, pb.Compressed):
            getattr(msg, key).CopyFrom(value)
        else:
            setattr(msg, key, value)
    return msg


def _reply_region(**fields: object):
    def run(call, stub):
        reply = call("OpenRegion", pb.OpenRegionRequest(nbytes=1 << 20))
        req = _fwd()
        req.reply_region.CopyFrom(pb.RegionSlice(region=reply.region, offset=0, nbytes=4096))
        for key, value in fields.items():
            setattr(req.reply_region, key, value)
        call("Forward", req)
    return run


# Tensors in a shared-memory region (client and trunk on one host): the server checks the region's owner and
# bounds and copies the bytes before checking them.
REGION_CASES: list[Case] = [
    ("region-unknown", C.NOT_FOUND, "is not open",
     _region_case(lambda call: _region_tensor(call, _hidden(), region="splitfed-" + "0" * 32))),
    ("region-of-another-client", C.PERMISSION_DENIED, "another client",
     _region_case(lambda call: _region_tensor(call, _hidden(), client="bob"))),
    ("region-slice-out-of-bounds", C.INVALID_ARGUMENT, "outside region",
     _region_case(lambda call: _region_tensor(call, _hidden(), offset=(1 << 20) - 64))),
    ("region-bytes-vs-shape", C.INVALID_ARGUMENT, "needs 1280 bytes",
     _region_case(lambda call: _region_tensor(call, _hidden(), nbytes=1024))),
    ("region-and-data", C.INVALID_ARGUMENT, "also carries",
     _region_case(lambda call: _with(_region_tensor(call, _hidden()), data=b"\0" * 1280))),
    ("region-and-compressed", C.INVALID_ARGUMENT, "also carries",
     _region_case(lambda call: _with(_region_tensor(call, _hidden()), compressed=pb.Compressed(
         method=pb.INT8_BLOCKWISE, dtype=pb.FLOAT32, block_size=64)))),
    ("region-nan", C.INVALID_ARGUMENT, "NaN",
     _region_case(lambda call: _region_tensor(call, _hidden().index_fill_(1, torch.tensor([2]), float("nan"))))),
    ("reply-region-unknown", C.NOT_FOUND, "is not open", _reply_region(region="splitfed-" + "1" * 32)),
    ("reply-region-out-of-bounds", C.INVALID_ARGUMENT, "outside region", _reply_region(offset=(1 << 20) - 100)),
    # The trunk here is on the CPU: its regions have no CUDA events to order copies by.
    ("region-event-without-events", C.INVALID_ARGUMENT, "has no events",
     _region_case(lambda call: _region_tensor(call, _hidden(), event=1))),
    ("reply-region-event-without-events", C.INVALID_ARGUMENT, "has no events", _reply_region(event=3)),
    # Nor GPU memory: a slice that names it is refused, with or without an event.
    ("region-gpu-memory-without-any", C.INVALID_ARGUMENT, "GPU memory",
     _region_case(lambda call: _region_tensor(call, _hidden(), device=True))),
    ("reply-region-gpu-memory-without-any", C.INVALID_ARGUMENT, "GPU memory", _reply_region(device=True)),
]


CASES: list[Case] = [
    ("unknown-dtype", C.INVALID_ARGUMENT, "dtype",
     lambda call, stub: call("Forward", _fwd(tensors=[_tensor("hidden", _hidden(), dtype=42)]))),
    ("unspecified-dtype", C.INVALID_ARGUMENT, "dtype",
     lambda call, stub: call("Forward", _fwd(tensors=[_tensor("hidden", _hidden(), dtype=0)]))),
    ("int-hidden", C.INVALID_ARGUMENT, "hidden",
     lambda call, stub: call("Forward", _fwd(tensors=[_tensor("hidden", torch.ones(2, 5, HIDDEN, dtype=torch.int32))]))),
    ("bytes-vs-shape", C.INVALID_ARGUMENT, "carries",
     lambda call, stub: call("Forward", _fwd(tensors=[_tensor("hidden", _hidden(), shape=[2, 5, HIDDEN + 1])]))),
    ("negative-dim", C.INVALID_ARGUMENT, "negative",
     lambda call, stub: call("Forward", _fwd(tensors=[_tensor("hidden", _hidden(), shape=[-2, 5, HIDDEN])]))),
    ("huge-declared-unary", C.INVALID_ARGUMENT, "above the limit",
     lambda call, stub: call("Forward", _fwd(tensors=[_tensor("hidden", _hidden(), shape=[1 << 30, 5, HIDDEN])]))),
    ("huge-declared-stream", C.RESOURCE_EXHAUSTED, "limit",
     lambda call, stub: _stream(stub, _stream_header([1 << 20, 64, HIDDEN]), [(0, b"\0" * 16)])),
    ("truncated-stream", C.INVALID_ARGUMENT, "truncated",
     lambda call, stub: _stream(stub, _stream_header([2, 5, HIDDEN]), [(0, b"\0" * 100)])),
    ("chunk-out-of-order", C.INVALID_ARGUMENT, "out of order",
     lambda call, stub: _stream(stub, _stream_header([2, 5, HIDDEN]), [(640, b"\0" * 640), (0, b"\0" * 640)])),
    ("stream-overflow", C.INVALID_ARGUMENT, "more than",
     lambda call, stub: _stream(stub, _stream_header([2, 5, HIDDEN]), [(0, b"\0" * 1280), (1280, b"\0" * 4)])),
    ("stream-without-header", C.INVALID_ARGUMENT, "header",
     lambda call, stub: list(stub.ForwardStream(iter([pb.Frame(chunk=pb.Chunk(offset=0, data=b"x"))]),
                                                metadata=[(CLIENT_ID_KEY, "a")], timeout=10))),
    ("oversize-message", C.RESOURCE_EXHAUSTED, "",
     lambda call, stub: call("Forward", _fwd(tensors=[_tensor("hidden", torch.randn(40, 64, HIDDEN * 4))]))),
    ("empty-tensor", C.INVALID_ARGUMENT, "empty",
     lambda call, stub: call("Forward", _fwd(tensors=[_tensor("hidden", torch.randn(0, 5, HIDDEN))]))),
    ("nan-hidden", C.INVALID_ARGUMENT, "NaN",
     lambda call, stub: call("Forward", _fwd(tensors=[_tensor("hidden", _hidden().index_fill_(1, torch.tensor([2]),
                                                                                            float("nan")))]))),
    ("inf-grad", C.INVALID_ARGUMENT, "NaN or Inf", _grad_nan),
    ("no-hidden", C.INVALID_ARGUMENT, "no 'hidden'",
     lambda call, stub: call("Forward", _fwd(tensors=[_tensor("attention_mask", torch.ones(2, 5, dtype=torch.long))]))),
    ("unknown-tensor-name", C.INVALID_ARGUMENT, "unexpected tensor",
     lambda call, stub: call("Forward", _fwd(tensors=[_tensor("hidden", _hidden()), _tensor("labels", torch.ones(2))]))),
    ("duplicate-tensor-name", C.INVALID_ARGUMENT, "twice",
     lambda call, stub: call("Forward", _fwd(tensors=[_tensor("hidden", _hidden()), _tensor("hidden", _hidden())]))),
    ("mask-shape", C.INVALID_ARGUMENT, "attention_mask",
     lambda call, stub: call("Forward", _fwd(tensors=[_tensor("hidden", _hidden()),
                                                      _tensor("attention_mask", torch.ones(3, 5, dtype=torch.long))]))),
    ("float-mask", C.INVALID_ARGUMENT, "integer",
     lambda call, stub: call("Forward", _fwd(tensors=[_tensor("hidden", _hidden()), _tensor("attention_mask",
                                                                                              torch.ones(2, 5))]))),
    ("wrong-hidden-size", C.INVALID_ARGUMENT, "hidden must be",
     lambda call, stub: call("Forward", _fwd(tensors=[_tensor("hidden", torch.randn(2, 5, HIDDEN + 8))]))),
    ("empty-activation-id", C.INVALID_ARGUMENT, "activation_id",
     lambda call, stub: call("Forward", pb.ForwardRequest(tensors=[_tensor("hidden", _hidden())]))),
    ("duplicate-activation-id", C.ALREADY_EXISTS, "already in use", _dup),
    ("backward-before-forward", C.NOT_FOUND, "no saved forward",
     lambda call, stub: call("Backward", _bwd("never-forwarded"))),
    ("backward-twice", C.FAILED_PRECONDITION, "already received", _twice),
    ("backward-after-eval-forward", C.NOT_FOUND, "no saved forward", _eval_then_backward),
    ("backward-expired", C.NOT_FOUND, "evicted", _expired),
    ("foreign-activation", C.PERMISSION_DENIED, "another client", _foreign),
    ("grad-shape-differs", C.INVALID_ARGUMENT, "differs", _grad_shape),
    ("grad-two-tensors", C.INVALID_ARGUMENT, "exactly one",
     lambda call, stub: call("Backward", pb.BackwardRequest(activation_id="x", tensors=[
         _tensor("grad", torch.ones(1)), _tensor("grad", torch.ones(1))]))),
    ("too-many-pending-forwards", C.RESOURCE_EXHAUSTED, "already holds", _per_client_cap),
    ("garbage-forward-payload", C.INVALID_ARGUMENT, "not a valid ForwardRequest",
     _raw("Forward", b"\xff\xff\xff\xff\x0f garbage")),
    ("garbage-backward-payload", C.INVALID_ARGUMENT, "not a valid BackwardRequest",
     _raw("Backward", b"\x0a\xff\xff\xff\xff\xff")),
    ("unknown-method", C.UNIMPLEMENTED, "", _raw("Explode", b"")),
    ("step-parts-without-step-id", C.INVALID_ARGUMENT, "step_id is empty", _step_fields("", 2)),
    ("step-parts-negative", C.INVALID_ARGUMENT, "step_parts must be", _step_fields("s", -1)),
    ("step-parts-change-within-a-step", C.INVALID_ARGUMENT, "same step_parts", _step_parts_change),
    ("unknown-session", C.NOT_FOUND, "session",
     lambda call, stub: call("Forward", pb.ForwardRequest(activation_id="s", session_id="nope",
                                                          tensors=[_tensor("hidden", _hidden())]))),
    # The trunk holds blocks [1, 3) of the model.
    ("cut-outside-trunk", C.INVALID_ARGUMENT, "outside this trunk's blocks [1, 3)",
     lambda call, stub: call("Forward", pb.ForwardRequest(activation_id=uuid.uuid4().hex, train=True, num_examples=2,
                                                          cut_start=1, cut_end=4,
                                                          tensors=[_tensor("hidden", _hidden())]))),
    ("cut-start-after-end", C.INVALID_ARGUMENT, "cut_start 3 > cut_end 2",
     lambda call, stub: call("Forward", pb.ForwardRequest(activation_id=uuid.uuid4().hex, train=True, num_examples=2,
                                                          cut_start=3, cut_end=2,
                                                          tensors=[_tensor("hidden", _hidden())]))),
    *REGION_CASES,
]


def test_catalogue_counts_every_case() -> None:
    # Exact: a case removed (or added) is a visible change here and in docs/bad_inputs.md's count.
    assert len(CASES) == 53 and len(REGION_CASES) == 13
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("served", ["per-client"], indirect=True)
def test_the_unchanged_check_sees_an_update_to_a_per_client_copy(served) -> None:
    # Prepare: a per-client trunk; a client's forward makes its copy (the global trunk's weights, untrained).
    server, _, call, _ = served
    snap = _trunk_snapshot(server)
    act = uuid.uuid4().hex
    call("Forward", _fwd(act), client="bob")
    _assert_unchanged(server, snap)  # a fresh copy is no change
    # Execute: a real gradient steps bob's copy (and nothing else: V1 leaves the global trunk alone in a round).
    reply = call("Backward", _bwd(act), client="bob")
    assert reply.outcome == pb.APPLIED and server.runtime.version == snap[2]
    # Assert: the check the catalogue runs after every bad request sees it.
    with pytest.raises(AssertionError):
        _assert_unchanged(server, snap)
    snap = _trunk_snapshot(server)
    call("Forward", _fwd(act2 := uuid.uuid4().hex), client="bob")
    call("Backward", _bwd(act2), client="bob")
    with pytest.raises(AssertionError):  # an existing copy's update too
        _assert_unchanged(server, snap)


@pytest.mark.parametrize("name, code, fragment, action", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_precise_status(served, name, code, fragment, action) -> None:
    server, stub, call, channel = served
    snap = [_trunk_snapshot(server)]
    _Marker.hook = lambda: snap.__setitem__(0, _trunk_snapshot(server))
    with pytest.raises(grpc.RpcError) as info:
        action(call, stub)
    snap = snap[0]
    assert info.value.code() == code, info.value.details()
    assert fragment in (info.value.details() or "")
    assert info.value.code() not in (C.UNKNOWN, C.INTERNAL)
    assert _serving(channel)
    _assert_unchanged(server, snap)
    # Forwards that are legitimately pending (the refused request consumed nothing) are finished by their
    # owners; the clients whose requests were refused hold nobody up.
    owners = set()
    for entry in server.runtime.store.entries():
        owners.add(entry.client_id)
        try:
            call("Backward", _bwd(entry.activation_id, torch.zeros_like(entry.out_value)), client=entry.client_id)
        except grpc.RpcError as exc:  # evicted meanwhile (0.5 s TTL)
            assert exc.code() == C.NOT_FOUND
    for owner in owners:  # done training: they leave the step group, as the client library does
        call("Leave", pb.LeaveRequest(), client=owner)
    snap = _trunk_snapshot(server)
    # The server still trains after the bad request, and the healthy client's step waits for nobody.
    act = uuid.uuid4().hex
    call("Forward", _fwd(act), client="healthy")
    start = time.monotonic()
    reply = call("Backward", _bwd(act), client="healthy")
    assert time.monotonic() - start < 10  # well under the 30 s timeout
    stepped = 0 if server.runtime.aggregator.mode == "per-client" else 1  # V1 steps the client's copy
    assert reply.outcome == pb.APPLIED and server.runtime.version == snap[2] + stepped


def test_large_tensors_stream_in_chunks_and_match_local(trunk_server) -> None:
    model = tiny_model("gpt2").train()
    ref = copy.deepcopy(model)
    split = split_model(model, cuts=(1, 3))
    limits = ChannelLimits(max_message_bytes=1 << 20, stream_threshold_bytes=256 << 10, chunk_bytes=100_000)
    server = trunk_server(split.trunk, lr=0.0, limits=limits) if False else trunk_server(split.trunk, limits=limits)
    client = TrunkClient(server.address, insecure=True, limits=limits)
    state = CutState(torch.randn(64, 64, HIDDEN), None, torch.arange(64).expand(64, 64))  # 512 KiB hidden
    out, version = client.forward(state, activation_id="big", train=True)
    with torch.no_grad():
        want = split_model(ref, cuts=(1, 3)).trunk(state).hidden
    assert torch.equal(out, want) and version == 0
    reply = client.backward("big", torch.ones_like(out))
    assert reply.grad.shape == state.hidden.shape and reply.outcome == "APPLIED"
    assert client.bytes_sent > 2 * (256 << 10)


def test_health_and_reflection(trunk_server) -> None:
    split = split_model(tiny_model("gpt2"), cuts=(1, 3))
    server = trunk_server(split.trunk)
    with grpc.insecure_channel(server.address) as channel:
        assert _serving(channel)
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert SERVICE_NAME in names and "grpc.health.v1.Health" in names
    server.stop(grace=0)
    with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError):
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=1)


def test_client_reports_failures_as_channel_errors() -> None:
    client = TrunkClient("127.0.0.1:1", insecure=True)
    with pytest.raises(ChannelError) as info:
        client.join()
    assert info.value.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")


def test_insecure_must_be_explicit() -> None:
    from splitfed.channel.server.trunkserver import TrunkServer
    from splitfed.errors import ConfigError

    with pytest.raises(ConfigError, match="insecure=True"):
        TrunkServer(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="insecure=True"):
        TrunkClient("127.0.0.1:1")


def test_cnn_reply_larger_than_request_falls_back_to_stream(trunk_server) -> None:
    # A trunk whose output is 8x its input: the unary reply would exceed the threshold.
    trunk_mod = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 1))
    from splitfed.split.sequential import split_sequential

    _, trunk, _ = split_sequential(torch.nn.Sequential(torch.nn.Identity(), *trunk_mod, torch.nn.Identity()), 1, 2)
    limits = ChannelLimits(max_message_bytes=1 << 20, stream_threshold_bytes=200_000, chunk_bytes=50_000)
    server = trunk_server(trunk, limits=limits)
    remote = RemoteTrunk(server.address, insecure=True, limits=limits)
    x = torch.randn(4, 1, 64, 64, requires_grad=True)  # 64 KiB in, 512 KiB out
    out = remote(CutState(x)).hidden
    assert out.shape == (4, 8, 64, 64)
    out.sum().backward()
    assert x.grad is not None and remote.outcomes == {"APPLIED": 1}


def test_remote_trunk_eval_mode_does_not_save_forwards(trunk_server) -> None:
    split = split_model(tiny_model("llama"), cuts=(1, 3))
    server = trunk_server(split.trunk)
    remote = RemoteTrunk(server.address, insecure=True).eval()
    ids, mask, _ = batch_for("llama")
    with torch.no_grad():
        state = split.bottom(ids, attention_mask=mask)
        out = remote(state)
        want = split.trunk(state)
    assert torch.equal(out.hidden, want.hidden)
    assert len(server.runtime.store) == 0


def test_wire_dtype_bf16_halves_the_bytes(trunk_server) -> None:
    split = split_model(tiny_model("llama").train(), cuts=(1, 3))
    server = trunk_server(split.trunk)
    ids, mask, _ = batch_for("llama")
    state = split.bottom(ids, attention_mask=mask)
    sent = {}
    for dtype in ("fp32", "bf16"):
        client = TrunkClient(server.address, insecure=True, wire_dtype=dtype)
        out, _ = client.forward(state, train=False)
        sent[dtype] = client.bytes_sent
        assert out.dtype == (torch.float32 if dtype == "fp32" else torch.bfloat16)
    hidden_bytes = state.hidden.numel() * 4
    assert sent["fp32"] - sent["bf16"] == hidden_bytes // 2
    assert len(encode_state(state, "bf16")) == 2  # hidden and mask: default positions do not travel
