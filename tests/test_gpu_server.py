"""A trunk server on a GPU serving clients whose tensors are in host memory (shared memory or the socket): the
cut's copies go by the copy engine and are checked on the device, and training stays exact. Skipped without a GPU
(run on a GPU machine: ``python -m pytest tests/test_gpu_server.py``)."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch
from conftest import tiny_model

from splitfed.channel.transports.shm import serverio as regionio
from splitfed.channel.transports.shm import lane as shared
from splitfed.channel.client.trunk import TrunkClient
from splitfed.channel.wire.limits import ChannelLimits
from splitfed.errors import ChannelError
from splitfed.split import CutState, split_model
from splitfed.trunk.device import placement
from splitfed.trunk.aggregation.modes import make_aggregator
from splitfed.trunk.device.transfers import DeviceIO, PinnedPool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")
LENGTHS = (5, 9, 3, 7)
#: Every tensor call streamed, in chunks smaller than a tensor.
STREAMED = ChannelLimits(stream_threshold_bytes=0, chunk_bytes=256)


@pytest.fixture(autouse=True)
def _exact_and_small(monkeypatch: pytest.MonkeyPatch):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # The tiny tensors of these tests take the paths large ones take.
    monkeypatch.setattr(regionio, "ARRIVAL_MIN_BYTES", 1)
    monkeypatch.setattr(placement, "ASYNC_HAND_BYTES", 1)
    monkeypatch.setattr(shared, "MIN_REGION_TENSOR_BYTES", 1)
    yield


def test_device_io_copies_in_and_out_and_reuses_its_pinned_buffers() -> None:
    io = DeviceIO(CUDA, PinnedPool())
    for step in range(6):
        x = torch.randn(3, 5, 7)
        pinned = x.pin_memory()
        for src in (x.view(torch.uint8).reshape(-1), memoryview(x.numpy()).cast("B"),
                    pinned.view(torch.uint8).reshape(-1)):
            a = io.stage("hidden", src, torch.float32, (3, 5, 7))
            assert io.bring([a]) == [True]
            assert torch.equal(a.tensor.cpu(), x)
        bad = x.clone()
        bad[1, 2, 3] = float("nan")
        huge = torch.full((3, 5, 7), 3e38)  # finite, though its norm overflows: confirmed element by element
        arrivals = [io.stage("hidden", t.view(torch.uint8).reshape(-1), torch.float32, (3, 5, 7))
                    for t in (x, bad, huge, x)]
        assert io.bring(arrivals) == [True, False, True, True]
        y = torch.randn(4, 6, device=CUDA)
        out = io.to_host(y, torch.bfloat16)
        out.event.synchronize()
        assert torch.equal(out.host, y.to(torch.bfloat16).cpu())
        dst = torch.empty(4 * 6 * 4, dtype=torch.uint8).pin_memory()
        direct = io.to_host(y, dst=dst)
        direct.event.synchronize()
        assert torch.equal(dst.view(torch.float32).view(4, 6).cpu(), y.cpu())
        del out, direct
        if step == 1:
            pinned_after_warmup = io.pool.allocated
    assert io.pool.allocated == pinned_after_warmup  # no new pinned buffer per call once warm


def test_a_reply_buffer_returns_to_the_pool_only_when_nothing_reads_its_bytes() -> None:
    io = DeviceIO(CUDA, PinnedPool())
    y = torch.randn(64, 64, device=CUDA)
    dep = io.to_host(y)
    dep.event.synchronize()
    # What an encoder keeps: a byte view of a view of the host tensor (not the tensor object itself).
    data = memoryview(dep.host.reshape(-1).view(torch.uint8).numpy())
    want = bytes(data)
    del dep
    for _ in range(20):  # other replies of the same size
        other = io.to_host(torch.randn(64, 64, device=CUDA))
        other.event.synchronize()
    assert bytes(data) == want


def _inputs(step: int) -> list[CutState]:
    g = torch.Generator().manual_seed(100 + step)
    return [CutState(torch.randn(2, n, 32, generator=g)) for n in LENGTHS]


def _run(trunk_server, device: torch.device, transport: str, window_ms: float, steps: int = 2,
         poison: int | None = None, wire: str = "none"):  # type: ignore[no-untyped-def]
    """4 clients (host tensors) train ``steps`` sync steps of a tiny Llama trunk on ``device``; client ``poison``
    sends NaN at its first forward; ``wire``: the clients' wire compression."""
    torch.manual_seed(0)
    split = split_model(tiny_model("llama").train(), cuts=(1, 3))
    server = trunk_server(split.trunk.to(device), lr=0.1, aggregator=make_aggregator("sync", timeout=60),
                          batch_window_ms=window_ms, bulk_connections=2 if transport == "bulk" else 0)
    outs: dict = {}
    errors: dict = {}
    start = threading.Barrier(len(LENGTHS))

    def client(i: int) -> None:
        streamed = transport in ("stream", "bulk")
        c = TrunkClient(server.address, insecure=True, client_id=f"c{i}",
                        shared_memory="off" if streamed else transport,
                        limits=STREAMED if streamed else ChannelLimits(),
                        bulk_connections=2 if transport == "bulk" else 0, wire_compression=wire)
        c.join()
        for step in range(steps):
            state = _inputs(step)[i]
            if poison == i and step == 0:
                state = CutState(state.hidden.clone().index_fill_(1, torch.tensor([0]), float("nan")))
            start.wait(30)
            act = uuid.uuid4().hex
            try:
                out, _ = c.forward(state, activation_id=act, train=True, num_examples=2 + i)
            except ChannelError as exc:
                errors[(i, step)] = exc
                continue
            reply = c.backward(act, torch.sin(out * (1 + i)))
            outs[(i, step)] = (out, reply.grad, reply.outcome)
        if transport == "bulk":
            assert c.bulk.calls == 2 * steps and c.bulk.failed is None
        c.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(LENGTHS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return split.trunk, server, outs, errors


@pytest.mark.parametrize("transport", ["on", "off", "stream", "bulk"])
def test_host_clients_of_a_gpu_trunk_train_as_on_the_cpu(trunk_server, transport: str) -> None:
    ref_trunk, _, ref_outs, _ = _run(trunk_server, torch.device("cpu"), "off", window_ms=0)
    trunk, server, outs, errors = _run(trunk_server, CUDA, transport, window_ms=500)
    assert not errors and len(outs) == len(ref_outs) == 2 * len(LENGTHS)
    io = server.runtime.io
    assert io.stats["in"] >= 2 * len(outs)  # every activation and gradient went to the GPU by the copy engine
    assert server.runtime._batches.stats["group-backwards"] >= 2
    if transport == "on":
        assert io.stats["out-direct"] >= 2 * len(outs)  # every reply went into the client's region directly
    elif transport == "off":
        assert io.stats["in-staged"] >= 2 * len(outs)
    else:  # streamed requests gathered (or read off a bulk link) in pinned memory: no copy before the copy engine's
        assert io.stats["in-staged"] == 0
    for key, (out, grad_in, outcome) in ref_outs.items():
        got_out, got_grad, got_outcome = outs[key]
        assert outcome == got_outcome == "APPLIED"
        assert torch.allclose(out, got_out, atol=1e-5, rtol=1e-5), key
        assert torch.allclose(grad_in, got_grad, atol=1e-5, rtol=1e-5), key
    for (name, a), b in zip(ref_trunk.state_dict().items(), trunk.state_dict().values()):
        assert torch.allclose(a, b.cpu(), atol=1e-5, rtol=1e-5), name


@pytest.mark.parametrize("transport", ["on", "off"])
def test_nan_from_a_host_client_is_refused_on_the_gpu_and_the_others_train(trunk_server, transport: str) -> None:
    _, server, outs, errors = _run(trunk_server, CUDA, transport, window_ms=500, steps=1, poison=2)
    assert list(errors) == [(2, 0)]
    assert errors[(2, 0)].code == "INVALID_ARGUMENT" and "NaN or Inf" in str(errors[(2, 0)])
    assert sorted(outs) == [(0, 0), (1, 0), (3, 0)]
    assert all(outcome == "APPLIED" for _, _, outcome in outs.values())
    assert server.runtime.version == 1


def test_a_retried_backward_gets_the_same_reply_from_a_gpu_trunk(trunk_server) -> None:
    import grpc

    from splitfed.channel.wire import split_channel_pb2 as pb
    from splitfed.channel.wire.limits import CLIENT_ID_KEY
    from splitfed.channel.wire.split_channel_pb2_grpc import SplitChannelStub
    from splitfed.channel.wire.messages import to_proto
    from splitfed.codec.tensors import encode

    split = split_model(tiny_model("llama").train(), cuts=(1, 3))
    server = trunk_server(split.trunk.to(CUDA))
    channel = grpc.insecure_channel(server.address)
    stub = SplitChannelStub(channel)
    md = [(CLIENT_ID_KEY, "alice")]
    act = uuid.uuid4().hex
    stub.Forward(pb.ForwardRequest(activation_id=act, train=True, num_examples=2,
                                   tensors=[to_proto(encode("hidden", torch.randn(2, 5, 32)))]), metadata=md,
                 timeout=20)
    request = pb.BackwardRequest(activation_id=act, tensors=[to_proto(encode("grad", torch.randn(2, 5, 32)))])
    first = stub.Backward(request, metadata=md, timeout=20)
    again = stub.Backward(request, metadata=md + [("x-splitfed-retry", "1")], timeout=20)
    assert again.SerializeToString() == first.SerializeToString() and server.runtime.version == 1
    assert server.runtime.io.stats["brought"] == 2 and server.runtime.io.stats["out"] >= 2
    channel.close()


@pytest.mark.parametrize("bulk", [0, 2])
def test_a_streamed_reply_to_a_gpu_client_gathers_in_pinned_memory(trunk_server, bulk: int) -> None:
    # Gathered from gRPC's chunks, or read off a bulk link (bulk > 0): pinned memory either way.
    split = split_model(tiny_model("llama"), cuts=(1, 3))
    server = trunk_server(split.trunk.to(CUDA), lr=0.1, bulk_connections=bulk)
    state = CutState(torch.randn(2, 7, 32, device=CUDA))
    with TrunkClient(server.address, insecure=True, shared_memory="off", limits=STREAMED,
                     bulk_connections=bulk) as c, \
            TrunkClient(server.address, insecure=True, shared_memory="off") as unary:
        out, _ = c.forward(state, train=False, owned=True)
        ref, _ = unary.forward(CutState(state.hidden.cpu()), train=False)
        act = uuid.uuid4().hex
        c.forward(state, activation_id=act, train=True)
        reply = c.backward(act, torch.ones(2, 7, 32, device=CUDA), owned=True)
        assert c.bulk.calls == (3 if bulk else 0) and c.bulk.failed is None
    assert out.is_pinned() and torch.equal(out, ref)  # handed over as received: already pinned, same bytes
    assert reply.grad.is_pinned() and reply.grad.shape == (2, 7, 32)


def test_streams_gather_in_pinned_memory_only_up_to_a_cap() -> None:
    import gc

    io = DeviceIO(CUDA, PinnedPool())
    io.max_gathering = 1 << 20  # a stream declares its size before its bytes come: pinned memory is lent up to this
    first = io.host_buffer(600_000)
    over = io.host_buffer(600_000)
    assert torch.from_numpy(first).is_pinned() and not torch.from_numpy(over).is_pinned()
    view = torch.frombuffer(memoryview(first)[1000:2000], dtype=torch.uint8)
    del first
    gc.collect()
    assert not torch.from_numpy(io.host_buffer(600_000)).is_pinned()  # still lent: a view of its bytes lives
    del view
    gc.collect()
    again = io.host_buffer(600_000)
    assert torch.from_numpy(again).is_pinned() and io.pool.allocated == 1  # given back, and reused


def test_streamed_requests_to_a_gpu_trunk_reuse_their_pinned_buffers(trunk_server) -> None:
    # A streamed request gathers in a pinned pool buffer that goes back once the call is done with it: by reference
    # count, not at the next garbage collection (tests/test_stream_lifetimes.py has the cycles this needs gone).
    import gc

    split = split_model(tiny_model("llama"), cuts=(1, 3))
    server = trunk_server(split.trunk.to(CUDA))
    state = CutState(torch.randn(2, 7, 32))
    calls = 16
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with TrunkClient(server.address, insecure=True, shared_memory="off", limits=STREAMED) as c:
            for _ in range(calls):
                c.forward(state, train=False)
    finally:
        if was:
            gc.enable()
    assert server.runtime.io.stats["in-staged"] == 0  # each request was gathered in pinned memory
    assert server.runtime.io.pool.allocated <= 4 < calls
