"""Compression over the real split channel: training with int8 and top-k, bytes counted, error feedback on
the server per client, and the catalogue of malformed compressed requests.

Every malformed compressed request gets INVALID_ARGUMENT, the server stays SERVING, and the trunk's weights
and optimizer state do not change.
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch
from conftest import tiny_model
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_channel import _assert_unchanged, _trunk_snapshot

from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.client.remote import RemoteTrunk
from splitfed.channel.client.trunk import TrunkClient
from splitfed.channel.server.trunkserver import CLIENT_ID_KEY, SERVICE_NAME, ChannelLimits, TrunkServer
from splitfed.channel.wire.split_channel_pb2_grpc import SplitChannelStub
from splitfed.channel.wire.messages import to_proto
from splitfed.codec.tensors import encode
from splitfed.codec.compression import CompressionSpec, WireCompression
from splitfed.data import batches, mnist
from splitfed.models.catalog import mnist_cnn
from splitfed.split import CutState, SplitModel, split_model
from splitfed.trunk.aggregation.modes import AsyncAggregator
from splitfed.trunk.compute.store import StoreLimits

C = grpc.StatusCode
HIDDEN = 32
INT8 = CompressionSpec("int8", block_size=32)
TOPK = CompressionSpec("topk", topk_ratio=0.1)


def _hidden(b: int = 2, t: int = 5) -> torch.Tensor:
    return torch.randn(b, t, HIDDEN)


@pytest.fixture
def served(trunk_server):
    """A llama trunk (AdamW, async) served with small limits; yields (server, stub, call, channel)."""
    split = split_model(tiny_model("llama").train(), cuts=(1, 3))
    limits = ChannelLimits(max_message_bytes=1 << 20, stream_threshold_bytes=512 << 10, chunk_bytes=64 << 10,
                           max_tensor_bytes=8 << 20)
    server = trunk_server(split.trunk, optimizer="adamw", lr=0.01, limits=limits,
                          aggregator=AsyncAggregator(max_staleness=4), store_limits=StoreLimits(max_per_client=4))
    channel = grpc.insecure_channel(server.address, options=limits.grpc_options())
    stub = SplitChannelStub(channel)

    def call(method: str, request: object, client: str = "alice") -> object:
        return getattr(stub, method)(request, metadata=[(CLIENT_ID_KEY, client)], timeout=20)

    yield server, stub, call, channel
    channel.close()


def _serving(channel: grpc.Channel) -> bool:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                                      timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _stream(stub, header: pb.ForwardRequest, chunks: list[tuple[int, bytes]]) -> None:
    frames = [pb.Frame(forward_request=header)] + [pb.Frame(chunk=pb.Chunk(offset=o, data=d)) for o, d in chunks]
    list(stub.ForwardStream(iter(frames), metadata=[(CLIENT_ID_KEY, "alice")], timeout=20))


# -- training -------------------------------------------------------------------------------------
@dataclass
class Trained:
    """A short training run of the MNIST CNN over the channel."""

    held_out_loss: float
    bytes_sent: int  # by the client while training
    bytes_received: int
    remote: RemoteTrunk
    server: TrunkServer


def _train(wire: str | WireCompression, steps: int = 150) -> Trained:
    """Train the MNIST CNN split over the channel with plain SGD; the server is stopped by the caller."""
    torch.manual_seed(0)
    parts = split_model(mnist_cnn(width=8), cuts=(3, 6))
    server = TrunkServer(parts.trunk, lr=0.1, insecure=True).start()
    remote = RemoteTrunk(server.address, insecure=True, wire_compression=wire)
    model = SplitModel(parts.bottom, remote, parts.top, task="classification")
    opt = torch.optim.SGD(parts.client_modules().parameters(), lr=0.1)
    data = batches(mnist()["train"], 32, "image", seed=3)
    for _ in range(steps):
        batch = next(data)
        loss = model(batch.inputs, labels=batch.labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    sent, received = remote.client.bytes_sent, remote.client.bytes_received
    test = next(batches(mnist()["test"], 1000, "image", shuffle=False))
    with torch.no_grad():
        held_out = float(model.eval()(test.inputs, labels=test.labels).loss)
    return Trained(held_out, sent, received, remote, server)


@pytest.fixture(scope="module")
def uncompressed() -> Iterator[Trained]:
    run = _train("none")
    run.server.stop(grace=0)
    yield run


def test_int8_training_reaches_the_loss_of_uncompressed_training_at_a_quarter_of_the_bytes(uncompressed) -> None:
    run = _train("int8")
    try:
        assert uncompressed.held_out_loss < 0.6  # it learned (chance is 2.3)
        assert abs(run.held_out_loss - uncompressed.held_out_loss) < 0.05 * uncompressed.held_out_loss
        assert uncompressed.bytes_sent / run.bytes_sent >= 3.5
        assert uncompressed.bytes_received / run.bytes_received >= 3.5
        # Activations carry no feedback; the server keeps the input-gradient residual of this client only.
        assert len(run.server.servicer.replies.store) == 1
        assert run.remote.client.feedback.residual("grad") is not None
        run.remote.client.leave()
        assert len(run.server.servicer.replies.store) == 0  # dropped when the client leaves
    finally:
        run.server.stop(grace=0)


def test_topk_gradients_with_error_feedback_train(uncompressed) -> None:
    run = _train(WireCompression.of("int8", grad="topk", topk_ratio=0.05))
    run.server.stop(grace=0)
    assert run.held_out_loss < 1.0  # it learned (chance is 2.3), if more slowly than uncompressed
    # Sent: int8 activations and 5% of the gradient (values and int32 positions); received: the same the
    # other way, where the activation is half the size and the input gradient twice.
    assert uncompressed.bytes_sent / run.bytes_sent > 4.5
    assert uncompressed.bytes_received / run.bytes_received > 6


def test_server_compresses_replies_as_each_request_asks(trunk_server) -> None:
    split = split_model(tiny_model("llama").train(), cuts=(1, 3))
    server = trunk_server(split.trunk)
    state = CutState(torch.randn(2, 5, HIDDEN), torch.ones(2, 5, dtype=torch.long),
                     torch.arange(5).expand(2, 5))
    plain = TrunkClient(server.address, insecure=True)
    packed = TrunkClient(server.address, insecure=True, wire_compression="int8")
    want, _ = plain.forward(state, train=False)
    got, _ = packed.forward(state, train=False)
    assert got.dtype == torch.float32 and (got - want).abs().max() <= want.abs().max() / 127
    # hidden compressed one way, mask and positions raw; int8 reply of 320 values with 3 scales of 128.
    assert packed.bytes_received == 320 + 3 * 4
    assert packed.bytes_sent == 320 + 3 * 4 + 2 * (2 * 5 * 8)


def test_streamed_compressed_requests_and_replies(trunk_server) -> None:
    split = split_model(tiny_model("gpt2").train(), cuts=(1, 3))
    limits = ChannelLimits(max_message_bytes=1 << 20, stream_threshold_bytes=64 << 10, chunk_bytes=10_000)
    server = trunk_server(split.trunk, limits=limits)
    client = TrunkClient(server.address, insecure=True, limits=limits, wire_compression="int8")
    state = CutState(torch.randn(64, 64, HIDDEN))  # 512 KiB fp32, 132 KiB as int8: still streamed
    out, _ = client.forward(state, activation_id="big", train=True)
    with torch.no_grad():
        want = split.trunk(CutState(state.hidden)).hidden
    assert (out - want).abs().max() < 0.05 * want.abs().max()
    reply = client.backward("big", torch.ones_like(out))
    assert reply.outcome == "APPLIED" and reply.grad.shape == state.hidden.shape
    assert client.bytes_sent > 2 * (64 << 10)


def test_retried_backward_gets_the_same_compressed_reply(trunk_server) -> None:
    split = split_model(tiny_model("llama").train(), cuts=(1, 3))
    server = trunk_server(split.trunk)
    channel = grpc.insecure_channel(server.address)
    stub = SplitChannelStub(channel)
    md = [(CLIENT_ID_KEY, "alice")]
    act = uuid.uuid4().hex
    stub.Forward(pb.ForwardRequest(activation_id=act, train=True, num_examples=2,
                                   tensors=[to_proto(encode("hidden", _hidden()))]), metadata=md, timeout=20)
    request = pb.BackwardRequest(activation_id=act, tensors=[to_proto(encode("grad", torch.randn(2, 5, HIDDEN)))],
                                 reply_compression=pb.CompressionSpec(method=pb.TOPK, topk_ratio=0.1,
                                                                      error_feedback=True))
    first = stub.Backward(request, metadata=md, timeout=20)
    residual = server.servicer.replies.store.residual("alice", "grad").clone()
    again = stub.Backward(request, metadata=md + [("x-splitfed-retry", "1")], timeout=20)
    assert again.SerializeToString() == first.SerializeToString() and server.runtime.version == 1
    assert torch.equal(server.servicer.replies.store.residual("alice", "grad"), residual)
    channel.close()


# -- bad compressed inputs ------------------------------------------------------------------------------
def _int8(tensor_dtype: int | None = None, data: bytes | None = None, **compressed: object) -> pb.Tensor:
    """An int8-compressed hidden state, with the tensor's dtype, data or descriptor fields replaced."""
    msg = to_proto(encode("hidden", _hidden(), None, INT8))
    if tensor_dtype is not None:
        msg.dtype = tensor_dtype
    if data is not None:
        msg.data = data
    for key, value in compressed.items():
        setattr(msg.compressed, key, value)
    return msg


def _topk(indices: list[int], values: int | None = None, value: float = 0.5) -> pb.Tensor:
    """A top-k gradient of shape (2, 5, HIDDEN) keeping ``indices`` (``values`` values, all ``value``)."""
    msg = to_proto(encode("grad", torch.randn(2, 5, HIDDEN), None, TOPK))
    n = len(indices) if values is None else values
    msg.compressed.indices = struct.pack(f"<{len(indices)}i", *indices)
    msg.compressed.count = len(indices)
    msg.data = struct.pack(f"<{n}f", *([value] * n))
    return msg


def _forward_with(tensor: pb.Tensor, **kwargs: object) -> Callable[..., object]:
    return lambda call, stub: call("Forward", pb.ForwardRequest(activation_id=uuid.uuid4().hex, train=True,
                                                                num_examples=2, tensors=[tensor], **kwargs))


def _backward_with(grad: pb.Tensor | None = None, **kwargs: object) -> Callable[..., object]:
    def run(call, stub) -> None:
        act = uuid.uuid4().hex
        call("Forward", pb.ForwardRequest(activation_id=act, train=True, num_examples=2,
                                          tensors=[to_proto(encode("hidden", _hidden()))]))
        tensor = grad if grad is not None else to_proto(encode("grad", torch.randn(2, 5, HIDDEN)))
        call("Backward", pb.BackwardRequest(activation_id=act, tensors=[tensor], **kwargs))
    return run


def _stream_with(tensor: pb.Tensor, chunks: list[tuple[int, bytes]]) -> Callable[..., object]:
    header = pb.ForwardRequest(activation_id=uuid.uuid4().hex, train=True, num_examples=2, tensors=[tensor])
    return lambda call, stub: _stream(stub, header, chunks)


def _header(**compressed: object) -> pb.Tensor:
    msg = _int8(**compressed)
    msg.data = b""
    return msg


_NAN = struct.pack("<f", float("nan"))
_INF = struct.pack("<f", float("inf"))
_SCALES = 2 * 5 * HIDDEN // INT8.block_size  # 10 blocks of 32

CASES = [
    ("int8-scale-count", "needs 10 scales, got 9", _forward_with(_int8(scales=b"\0" * 4 * (_SCALES - 1)))),
    ("int8-payload-count", "carries 319 bytes", _forward_with(_int8(data=b"\1" * 319))),
    ("int8-payload-with-fp32-dtype", "int8 payloads travel as INT8", _forward_with(_int8(tensor_dtype=pb.FLOAT32))),
    ("int8-nan-scale", "finite", _forward_with(_int8(scales=_NAN * _SCALES))),
    ("int8-inf-scale", "finite", _forward_with(_int8(scales=b"\0" * 4 * (_SCALES - 1) + _INF))),
    ("int8-negative-scale", ">= 0", _forward_with(_int8(scales=struct.pack("<f", -1.0) * _SCALES))),
    ("int8-zero-block-size", "block_size 0", _forward_with(_int8(block_size=0))),
    ("compressed-integer-target", "decode to FLOAT32", _forward_with(_int8(dtype=pb.INT64))),
    ("compressed-unknown-method", "unknown compression method", _forward_with(_int8(method=7))),
    ("topk-index-out-of-range", "out of range", _backward_with(_topk([0, 5, 320]))),
    ("topk-negative-index", "out of range", _backward_with(_topk([-1, 5, 9]))),
    ("topk-duplicate-index", "duplicates", _backward_with(_topk([3, 7, 7, 9]))),
    ("topk-unsorted-index", "not sorted", _backward_with(_topk([9, 3, 7]))),
    ("topk-values-count", "declares 3 values but carries 4 values", _backward_with(_topk([1, 2, 3], values=4))),
    ("topk-count-above-elements", "keeps 321 of 320", _backward_with(_topk(list(range(320)) + [0]))),
    ("topk-nan-value", "NaN or Inf", _backward_with(_topk([1, 2], value=float("nan")))),
    ("reply-topk-ratio-out-of-range", "topk_ratio", _backward_with(
        reply_compression=pb.CompressionSpec(method=pb.TOPK, topk_ratio=1.5))),
    ("reply-unknown-method", "unknown method", _forward_with(
        to_proto(encode("hidden", _hidden())), reply_compression=pb.CompressionSpec(method=5))),
    ("stream-compressed-inline-scales", "inline scales", _stream_with(_header(), [(0, b"\0" * 320)])),
    ("stream-compressed-truncated", "truncated", _stream_with(_header(scales=b""), [(0, b"\0" * 320)])),
]


def test_compressed_catalogue_counts_every_case() -> None:
    # Exact: a case removed (or added) is a visible change here and in docs/bad_inputs.md's count.
    assert len({c[0] for c in CASES}) == len(CASES) == 20


@pytest.mark.parametrize("name, fragment, action", CASES, ids=[c[0] for c in CASES])
def test_malformed_compressed_input_is_refused_and_changes_nothing(served, name, fragment, action) -> None:
    server, stub, call, channel = served
    snap = _trunk_snapshot(server)
    with pytest.raises(grpc.RpcError) as info:
        action(call, stub)
    assert info.value.code() == C.INVALID_ARGUMENT, info.value.details()
    assert fragment in (info.value.details() or ""), info.value.details()
    assert _serving(channel)
    _assert_unchanged(server, snap)
    assert len(server.servicer.replies.store) == 0
    # The server still trains, compressed both ways, after the bad request.
    client = TrunkClient(server.address, insecure=True, client_id="healthy", wire_compression="int8",
                         limits=server.limits)
    act = uuid.uuid4().hex
    out, _ = client.forward(CutState(_hidden()), activation_id=act)
    reply = client.backward(act, torch.ones_like(out))
    assert reply.outcome == "APPLIED" and server.runtime.version == snap[2] + 1
    client.close()


# -- through the Flower apps ------------------------------------------------------------------------------
def test_run_config_compresses_the_apps_traffic(tmp_path) -> None:
    import json

    from flower_harness import run_apps

    sent = {}
    for wire in ("none", "int8"):
        _, out = run_apps(tmp_path / wire, num_nodes=2, concurrency=2, num_server_rounds=1, local_steps=4,
                          eval_batches=2, wire_compression=wire, trunk_mode="async")
        history = json.loads((out / "history.json").read_text())["rounds"][0]
        assert history["train"]["train-steps"] == 2 * 4
        sent[wire] = {k: history[kind][k] for kind in ("train", "evaluate")
                      for k in (f"{kind[:5] if kind == 'train' else 'eval'}-bytes-sent",
                                f"{kind[:5] if kind == 'train' else 'eval'}-bytes-received")}
    for key, value in sent["none"].items():
        assert value / sent["int8"][key] >= 3.5, key


@pytest.mark.slow
def test_main_job_through_flwr_run_with_int8(tmp_path) -> None:
    """The README's main job through ``flwr run . local``, uncompressed and int8 (each with a SuperLink of its own)."""
    from bench.compression import SETTINGS, flwr_run, summarize

    runs = {name: summarize(flwr_run(SETTINGS[name], tmp_path / name)) for name in ("none", "int8")}
    assert runs["none"]["mb_per_round"] / runs["int8"]["mb_per_round"] >= 3.5
    assert runs["int8"]["final_accuracy"] >= 0.90
    # Within a point of uncompressed, plus a point for the run-to-run noise of a 5-round run.
    assert runs["int8"]["final_accuracy"] >= runs["none"]["final_accuracy"] - 0.02
