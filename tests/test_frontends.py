"""Front-end processes: several processes take a trunk server's calls in on its port and hand them to the engine
over a local link (``TrunkServer(frontends=N)``). Training through them equals training against the engine
directly, every status and message reaches the client unchanged, and only a process with the link's secret is
served."""

from __future__ import annotations

import asyncio
import threading
import uuid

import grpc
import pytest
import torch
from conftest import tiny_model
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitfed.channel.transports.shm import serverio as regionio
from splitfed.channel.transports.shm import lane as shared
from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.client.trunk import TrunkClient
from splitfed.channel.wire.framing import FrameLimits, pieces, read_frame, write_frame
from splitfed.channel.wire.limits import CLIENT_ID_KEY, SERVICE_NAME
from splitfed.channel.transports.shm.regions import SharedRegion
from splitfed.channel.wire.split_channel_pb2_grpc import SplitChannelStub
from splitfed.split import CutState, split_model
from splitfed.trunk.aggregation.modes import make_aggregator

LENGTHS = (5, 9, 3, 7)


def _train(trunk_server, frontends: int, steps: int = 2):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    split = split_model(tiny_model("llama").train(), cuts=(1, 3))
    server = trunk_server(split.trunk, lr=0.1, aggregator=make_aggregator("sync", timeout=60), batch_window_ms=2000,
                          frontends=frontends)
    outs: dict = {}
    start = threading.Barrier(len(LENGTHS))

    def client(i: int) -> None:
        with TrunkClient(server.address, insecure=True, client_id=f"c{i}") as c:
            c.join()
            for step in range(steps):
                state = CutState(torch.randn(2, LENGTHS[i], 32, generator=torch.Generator().manual_seed(10 * i + step)))
                start.wait(60)
                act = uuid.uuid4().hex
                out, _ = c.forward(state, activation_id=act, train=True, num_examples=2 + i)
                reply = c.backward(act, torch.sin(out * (1 + i)))
                outs[(i, step)] = (out, reply.grad, reply.outcome)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(LENGTHS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return split.trunk, server, outs


@pytest.mark.parametrize("regions", [False, True])
def test_training_through_front_ends_equals_training_against_the_engine(trunk_server, monkeypatch,
                                                                        regions: bool) -> None:
    opened: list[str] = []
    if regions:  # the tiny tensors travel through shared-memory regions, which the engine reads itself
        monkeypatch.setattr(shared, "MIN_REGION_TENSOR_BYTES", 1)
        monkeypatch.setattr(regionio, "ARRIVAL_MIN_BYTES", 1)
        create = SharedRegion.create
        monkeypatch.setattr(SharedRegion, "create", classmethod(
            lambda cls, nbytes: opened.append("region") or create(nbytes)))
    ref_trunk, _, ref_outs = _train(trunk_server, frontends=0)
    trunk, server, outs = _train(trunk_server, frontends=2)
    assert sorted(outs) == sorted(ref_outs) and len(outs) == 2 * len(LENGTHS)
    assert server.frontends.alive() == 2
    assert server.frontends.listener.stats["calls"] >= 2 * len(outs)  # every Forward and Backward came over the link
    for key, (out, grad_in, outcome) in ref_outs.items():
        assert outcome == outs[key][2] == "APPLIED"
        assert torch.allclose(out, outs[key][0], atol=1e-6, rtol=1e-6)
        assert torch.allclose(grad_in, outs[key][1], atol=1e-6, rtol=1e-6)
    for (name, a), b in zip(ref_trunk.state_dict().items(), trunk.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-6), name
    assert server.runtime.version == 2
    if regions:
        assert len(opened) >= 2 * len(LENGTHS)  # each client had a region, with each server
        assert server.runtime.io.stats["brought"] >= 2 * len(outs)  # every tensor was brought by the engine


def test_statuses_health_and_streams_cross_a_front_end_unchanged(trunk_server) -> None:
    split = split_model(tiny_model("llama").train(), cuts=(1, 3))
    server = trunk_server(split.trunk, frontends=1)
    with grpc.insecure_channel(server.address) as channel:
        stub = SplitChannelStub(channel)
        with pytest.raises(grpc.RpcError) as err:  # the engine's own status and message
            stub.Backward(pb.BackwardRequest(activation_id="never-sent"), metadata=[(CLIENT_ID_KEY, "a")], timeout=20)
        direct = trunk_server(split_model(tiny_model("llama").train(), cuts=(1, 3)).trunk)
        with grpc.insecure_channel(direct.address) as d, pytest.raises(grpc.RpcError) as want:
            SplitChannelStub(d).Backward(pb.BackwardRequest(activation_id="never-sent"),
                                         metadata=[(CLIENT_ID_KEY, "a")], timeout=20)
        assert (err.value.code(), err.value.details()) == (want.value.code(), want.value.details())
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                                        timeout=20)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as unknown:
            channel.unary_unary("/splitfed.v1.SplitChannel/NoSuchMethod")(b"", timeout=20)
        assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # A tensor above the unary threshold travels over ForwardStream, through the front-end too.
    from splitfed.channel.wire.limits import ChannelLimits

    limits = ChannelLimits(stream_threshold_bytes=1024)
    with TrunkClient(server.address, insecure=True, limits=limits, shared_memory="off") as c:
        state = CutState(torch.randn(4, 16, 32))
        out, _ = c.forward(state, train=False)
    with torch.no_grad():
        assert torch.allclose(out, split.trunk(state).hidden, atol=1e-6)
    assert server.frontends.listener.stats["calls"] >= 4


def test_only_a_process_with_the_links_secret_is_served(trunk_server) -> None:
    server = trunk_server(split_model(tiny_model("llama").train(), cuts=(1, 3)).trunk, frontends=1)
    listener = server.frontends.listener

    async def intrude(secret: str) -> dict:
        reader, writer = await asyncio.open_unix_connection(listener.path)
        try:  # the link may close on a wrong secret before the call is even written
            await write_frame(writer, {"secret": secret})
            await write_frame(writer, {"id": 1, "method": f"/{SERVICE_NAME}/Info", "md": [], "peer": "x"},
                              [pb.InfoRequest().SerializeToString()])
            header, _ = await asyncio.wait_for(read_frame(reader, FrameLimits(1 << 20)), 30)
        except Exception as exc:  # noqa: BLE001 - the link closed on it
            header = {"closed": repr(exc)}
        writer.close()
        return header

    calls = listener.stats["calls"]
    refused = asyncio.run(intrude("not-the-secret"))
    assert "closed" in refused and listener.stats["calls"] == calls  # nothing ran
    served = asyncio.run(intrude(listener.secret))
    assert served.get("code") == "OK"


def test_a_trunk_server_refuses_front_ends_with_tls_but_no_pem(trunk_server) -> None:
    from splitfed.errors import ConfigError

    with pytest.raises(ConfigError, match="frontend_tls"):
        trunk_server(split_model(tiny_model("llama").train(), cuts=(1, 3)).trunk, insecure=False,
                     credentials=grpc.ssl_server_credentials([(b"k", b"c")]), frontends=1)


class _Frames:
    """What the engine writes back to a front-end (a stand-in for its connection)."""

    def __init__(self) -> None:
        self.data = bytearray()

    async def write(self, header: dict, parts: list[bytes] = ()) -> None:
        for piece in pieces(header, parts):
            self.data += piece


def test_the_engine_answers_a_handed_over_call_at_its_deadline_and_a_cancel_at_once() -> None:
    """A call whose work outlasts the deadline the front-end passed on is answered DEADLINE_EXCEEDED then (not
    when the work ends), a cancelled one CANCELLED, and one within its deadline with its reply."""
    from splitfed.channel.engine.link import EngineListener

    class Dispatch:
        async def run(self, header: dict, body: bytes) -> tuple[dict, list[bytes]]:
            await asyncio.sleep(float(header["work"]))
            return {"code": "OK"}, [b"done"]

    async def serve(header: dict, cancel_after: float | None = None) -> tuple[dict, float]:
        listener, frames = EngineListener("unused", "secret", Dispatch(), 1 << 20), _Frames()
        loop = asyncio.get_running_loop()
        began = loop.time()
        task = asyncio.ensure_future(listener._serve(3, header, b"", frames))
        if cancel_after is not None:
            await asyncio.sleep(cancel_after)
            task.cancel()
        await task
        reader = asyncio.StreamReader()
        reader.feed_data(bytes(frames.data))
        reply, body = await read_frame(reader, FrameLimits(1 << 20))
        return {**reply, "body": body}, loop.time() - began

    async def scenario() -> None:
        late, took = await serve({"timeout": 0.2, "work": 5})
        assert late["code"] == "DEADLINE_EXCEEDED" and late["id"] == 3 and took < 2
        cancelled, took = await serve({"timeout": 30, "work": 5}, cancel_after=0.1)
        assert cancelled["code"] == "CANCELLED" and took < 2
        ok, _ = await serve({"timeout": 5, "work": 0.01})
        assert ok["code"] == "OK" and ok["body"] == b"done"
        untimed, _ = await serve({"work": 0.01})
        assert untimed["code"] == "OK" and untimed["body"] == b"done"

    asyncio.run(scenario())
