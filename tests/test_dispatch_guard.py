"""The dispatcher's guard around a model's handlers, each behaviour on its own.

A call whose handler was looked up while its model was READY can start after the model left READY (an unload
began in between): the guard refuses it with UNAVAILABLE before the model's handler runs. A call cancelled
while the model's handler works (an unload past its drain deadline, a client that went away) leaves that work
running to its end: the device thread's futures must never be cancelled halfway.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from splitfed.channel.server.dispatch import _tracked
from splitfed.channel.server.units import ModelState


class Aborted(Exception):
    """What grpc.aio's ``context.abort`` raises (it never returns)."""


class Context:
    """The part of a grpc.aio servicer context the guard uses."""

    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise Aborted(details)


def _unit(state: ModelState) -> Any:
    return SimpleNamespace(name="gpt2", state=state, in_flight=0, calls=set())


@pytest.mark.parametrize("state", [ModelState.UNLOADING, ModelState.LOADING, ModelState.FAILED])
def test_a_call_that_starts_after_its_model_left_ready_is_refused_before_the_model_sees_it(
        state: ModelState) -> None:
    seen: list[str] = []

    async def inner(request: bytes, context: Any) -> bytes:
        seen.append("unary")
        return b"reply"

    async def inner_stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        seen.append("stream")
        yield b"reply"

    async def main() -> None:
        unit = _unit(state)
        unary = _tracked(grpc.unary_unary_rpc_method_handler(inner), unit).unary_unary
        stream = _tracked(grpc.stream_stream_rpc_method_handler(inner_stream), unit).stream_stream
        context = Context()
        with pytest.raises(Aborted):
            await unary(b"request", context)
        assert context.aborted is not None and context.aborted[0] is grpc.StatusCode.UNAVAILABLE
        assert "being unloaded" in context.aborted[1]
        context = Context()
        with pytest.raises(Aborted):
            async for _ in stream(None, context):
                pass
        assert context.aborted is not None and context.aborted[0] is grpc.StatusCode.UNAVAILABLE
        assert unit.in_flight == 0 and not unit.calls

    asyncio.run(main())
    assert seen == []  # the model's handlers never ran


def test_a_ready_models_call_runs_and_is_counted_while_it_runs() -> None:
    async def main() -> None:
        unit = _unit(ModelState.READY)
        counted: list[int] = []

        async def inner(request: bytes, context: Any) -> bytes:
            counted.append(unit.in_flight)
            return request + b"!"

        unary = _tracked(grpc.unary_unary_rpc_method_handler(inner), unit).unary_unary
        assert await unary(b"x", Context()) == b"x!"
        assert counted == [1] and unit.in_flight == 0 and not unit.calls

    asyncio.run(main())


@pytest.mark.parametrize("state_then", [ModelState.READY, ModelState.UNLOADING])
def test_cancelling_a_call_leaves_the_models_work_running_to_its_end(state_then: ModelState) -> None:
    async def main() -> None:
        unit = _unit(ModelState.READY)
        started, release = asyncio.Event(), asyncio.Event()
        finished: list[str] = []

        async def inner(request: bytes, context: Any) -> bytes:
            started.set()
            await release.wait()  # the device thread's work, in flight
            finished.append("unary")
            return b"reply"

        async def inner_stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
            started.set()
            await release.wait()
            finished.append("stream")
            yield b"reply"

        unary = _tracked(grpc.unary_unary_rpc_method_handler(inner), unit).unary_unary
        stream = _tracked(grpc.stream_stream_rpc_method_handler(inner_stream), unit).stream_stream

        async def drain(context: Context) -> list[bytes]:
            return [reply async for reply in stream(None, context)]

        for call in (lambda c: unary(b"x", c), drain):
            started.clear()
            release.clear()
            context = Context()
            task = asyncio.ensure_future(call(context))
            await started.wait()
            assert unit.in_flight == 1
            unit.state = state_then
            task.cancel()
            with pytest.raises((asyncio.CancelledError, Aborted)):
                await task
            if state_then is ModelState.UNLOADING:  # an unload's deadline: the client is told to retry
                assert context.aborted is not None and context.aborted[0] is grpc.StatusCode.UNAVAILABLE
                assert "unloaded before this call finished" in context.aborted[1]
            assert unit.in_flight == 0  # the call is answered: the drain does not wait on it
            release.set()
            for _ in range(20):
                await asyncio.sleep(0)
            unit.state = ModelState.READY
        assert finished == ["unary", "stream"]  # the work went on to its end, uncancelled

    asyncio.run(main())
