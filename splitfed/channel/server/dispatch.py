"""Hands each split-channel call to the model it names: one generic handler in front of the units' handlers.

The ``x-splitfed-model`` metadata names the model. Without it, a server that holds
exactly one model serves that one (every client that predates several models keeps
working); a server holding several answers INVALID_ARGUMENT with the names it holds.
A name the server does not hold gets NOT_FOUND with the names it holds; a model that
is loading or being unloaded answers UNAVAILABLE (a retry later can succeed), one
whose load failed FAILED_PRECONDITION. Refused calls never reach a unit, so nothing
of any model changes.

Calls in flight are counted per unit (on the event loop's thread, where the registry
changes states too), so that an unload lets them finish: a unit marked UNLOADING
takes no new call, and a call it still runs past the drain's deadline is ended with
UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from splitfed.channel.engine.loop import detach, shielded_work
from splitfed.channel.server.handlers import released
from splitfed.channel.wire.limits import MODEL_KEY, SERVICE_NAME
from splitfed.channel.server.units import ModelState, ModelUnit

_STREAMS = frozenset({"ForwardStream", "BackwardStream"})
_PREFIX = f"/{SERVICE_NAME}/"


class Refused(Exception):
    """A call the dispatcher answers itself, with ``code`` and a message that says what to do."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _refusal(stream: bool, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler that answers ``code``/``message`` without reading the request."""
    if stream:
        async def refuse_stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
            await context.abort(code, message)
            yield b""  # pragma: no cover - abort raises
        return grpc.stream_stream_rpc_method_handler(refuse_stream)

    async def refuse(request: bytes, context: Any) -> bytes:
        await context.abort(code, message)
        return b""  # pragma: no cover - abort raises
    return grpc.unary_unary_rpc_method_handler(refuse)


def going_away(name: str) -> str:
    """What a call to a model being unloaded is told."""
    return (f"model {name!r} is being unloaded; its sessions are closed and its saved forwards dropped: retry on "
            "a server that holds it, or after it is loaded again")


def _unloaded(name: str) -> str:
    return f"model {name!r} was unloaded before this call finished; retry once it is loaded again"


def _detached(task: asyncio.Future[Any]) -> None:
    """Let ``task`` finish on its own, its outcome dropped (its call was answered already)."""
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


def _tracked(handler: grpc.RpcMethodHandler, unit: ModelUnit) -> grpc.RpcMethodHandler:
    """``handler`` with the unit's in-flight count kept, refusing calls once the unit is unloading.

    The unit's handler runs in a task of its own that the call awaits shielded (a unary call through
    :func:`~splitfed.channel.engine.loop.shielded_work`, whose future the work settles itself): an unload past its
    drain deadline cancels the call (which then answers UNAVAILABLE), never the work already handed to the device
    thread, whose futures must stay uncancelled.

    That future (a stream's: the task of its next reply) holds the exception that ended the work, whose traceback
    holds the call's frame; the frame lets go of it as it ends. Else the cycle would keep the call's request (a
    streamed tensor's whole buffer) until the next garbage collection, which a serving process runs rarely. A
    refused call ends with the handler's ``context.abort``, whose exception gRPC keeps with the call's context: it
    leaves here without the frames it came through (:func:`~splitfed.channel.server.handlers.released`).
    """

    def enter() -> None:
        unit.in_flight += 1
        task = asyncio.current_task()
        if task is not None:
            unit.calls.add(task)

    def leave() -> None:
        unit.in_flight -= 1
        task = asyncio.current_task()
        if task is not None:
            unit.calls.discard(task)

    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary(request: Any, context: Any) -> Any:
            if unit.state is not ModelState.READY:
                await context.abort(grpc.StatusCode.UNAVAILABLE, going_away(unit.name))
            enter()
            # The servicer's handlers never ask for their task (see own_work).
            outcome, work = shielded_work(inner(request, context))
            del request  # the handler holds it as long as it needs it (see above)
            try:
                return await outcome
            except asyncio.CancelledError:
                if work.done():
                    raise
                detach(work)
                if unit.state is ModelState.UNLOADING:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, _unloaded(unit.name))
                raise
            except grpc.aio.AbortError as abort:
                raise released(abort)
            finally:
                leave()
                del outcome, work  # no cycle (see above)

        return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)
    if handler.stream_stream is not None:
        inner_stream = handler.stream_stream

        async def stream(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
            if unit.state is not ModelState.READY:
                await context.abort(grpc.StatusCode.UNAVAILABLE, going_away(unit.name))
            enter()
            replies = inner_stream(requests, context).__aiter__()
            step: asyncio.Future[Any] | None = None
            try:
                while True:
                    step = asyncio.ensure_future(replies.__anext__())
                    try:
                        reply = await asyncio.shield(step)
                    except StopAsyncIteration:
                        return
                    except grpc.aio.AbortError as abort:
                        raise released(abort)
                    except asyncio.CancelledError:
                        if step.done():
                            raise
                        _detached(step)
                        if unit.state is ModelState.UNLOADING:
                            await context.abort(grpc.StatusCode.UNAVAILABLE, _unloaded(unit.name))
                        raise
                    yield reply
            finally:
                leave()
                step = None  # no cycle (see above)

        return grpc.stream_stream_rpc_method_handler(stream, request_deserializer=handler.request_deserializer,
                                                     response_serializer=handler.response_serializer)
    return handler


class ModelDispatch(grpc.GenericRpcHandler):
    """The split channel's generic handler: route by model name, count calls in flight.

    Args:
        route: the model name of a call ("" when it names none) -> its unit, or :class:`Refused`.
    """

    def __init__(self, route: Callable[[str], ModelUnit]) -> None:
        self.route = route

    def service(self, handler_call_details: Any) -> grpc.RpcMethodHandler | None:
        method: str = handler_call_details.method
        if not method.startswith(_PREFIX):
            return None
        name = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == MODEL_KEY and isinstance(value, str):
                name = value
        try:
            unit = self.route(name)
        except Refused as exc:
            return _refusal(method[len(_PREFIX):] in _STREAMS, exc.code, str(exc))
        tracked = unit.tracked.get(method)
        if tracked is None:  # the wrapper holds nothing of one call: made once per method and unit
            handler = unit.handler.service(handler_call_details)
            if handler is None:
                return None
            tracked = unit.tracked[method] = _tracked(handler, unit)
        return tracked
