"""Retries and idempotent step ids over every transport: a call whose reply is lost is retried, and the retry is
answered from what the first attempt left (a saved forward, a remembered backward), so the trunk steps exactly as
often, and to exactly the same weights, as without the fault; a step id used twice by a new forward is refused."""

from __future__ import annotations

import threading
import uuid

import grpc
import pytest
import torch

from splitfed.channel.wire.retry import RetryPolicy
from splitfed.errors import ChannelError
from splitfed.split import CutState

from .conftest import Conn
from .transports import HIDDEN, ROWS, TOKENS, Transport, hidden, trunk

STEPS = 3


class LoseEveryOtherReply(grpc.aio.ServerInterceptor):
    """Fault injection: every Forward and Backward (unary or streamed) runs, and the reply of each call's first
    attempt is lost (UNAVAILABLE). Attempts alternate (calls are sent one at a time), so no retry marker is needed:
    the interceptor works the same wherever the server's handlers run (gRPC, direct calls)."""

    def __init__(self) -> None:
        self.attempts = 0
        self.lost = 0
        self._lock = threading.Lock()

    def _lose(self) -> bool:
        with self._lock:
            self.attempts += 1
            lose = self.attempts % 2 == 1
            self.lost += lose
            return lose

    async def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        handler = await continuation(details)
        if handler is None or not details.method.endswith(("/Forward", "/Backward", "Stream")):
            return handler
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):  # type: ignore[no-untyped-def]
                reply = await inner(request, context)
                if self._lose():
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "injected fault: reply lost")
                return reply

            return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=handler.request_deserializer,
                                                       response_serializer=handler.response_serializer)
        inner_stream = handler.stream_stream

        async def stream(requests, context):  # type: ignore[no-untyped-def]
            replies = [r async for r in inner_stream(requests, context)]
            if self._lose():
                await context.abort(grpc.StatusCode.UNAVAILABLE, "injected fault: reply lost")
            for r in replies:
                yield r

        return grpc.stream_stream_rpc_method_handler(stream, request_deserializer=handler.request_deserializer,
                                                     response_serializer=handler.response_serializer)


def _steps(transport: Transport, interceptors: list) -> tuple[list[torch.Tensor], object]:
    """``STEPS`` forward/backward pairs over ``transport``; the outputs and input gradients, and the server."""
    server = transport.open_server(trunk(), interceptors=interceptors)
    client = transport.open_client(server, retry=RetryPolicy(initial_backoff_s=0.01, max_backoff_s=0.02))
    try:
        torch.manual_seed(1)
        seen = []
        for _ in range(STEPS):
            act = uuid.uuid4().hex
            out, _ = client.forward(CutState(hidden().to(transport.device)), activation_id=act)
            seen += [out, client.backward(act, (out * 0.5).to(transport.device)).grad]
        return seen, server, transport.went(server, client)
    finally:
        client.close()
        server.stop(grace=0)


def test_a_retried_call_is_applied_once(transport: Transport) -> None:
    clean, clean_server, _ = _steps(transport, [])
    faults = LoseEveryOtherReply()
    faulty, faulty_server, went = _steps(transport, [faults])
    assert faults.lost == 2 * STEPS and faults.attempts == 4 * STEPS  # every call lost once, retried once
    assert faulty_server.runtime.version == clean_server.runtime.version == STEPS
    assert faulty_server.runtime.stats["forwards"] == clean_server.runtime.stats["forwards"] == STEPS
    assert all(torch.equal(a, b) for a, b in zip(clean, faulty))
    for (name, a), b in zip(clean_server.runtime.trunk.state_dict().items(),
                            faulty_server.runtime.trunk.state_dict().values()):
        assert torch.equal(a, b), name
    if transport.retry_leaves:  # the first attempt went over the transport, the retries another way
        assert went == 0
    else:
        assert went == 2 * STEPS, f"the retries did not go over {transport.name}"


def test_a_step_id_used_twice_is_refused_and_the_first_step_completes(conn: Conn) -> None:
    act = uuid.uuid4().hex
    version, went = conn.server.runtime.version, conn.went()
    out, _ = conn.client.forward(CutState(hidden().to(conn.transport.device)), activation_id=act)
    with pytest.raises(ChannelError) as info:
        conn.client.forward(CutState(hidden().to(conn.transport.device)), activation_id=act)
    assert info.value.code == "ALREADY_EXISTS"
    reply = conn.client.backward(act, torch.zeros(ROWS, TOKENS, HIDDEN, device=conn.transport.device))
    assert reply.outcome == "APPLIED" and conn.server.runtime.version == version + 1
    assert conn.went() == went + 2
