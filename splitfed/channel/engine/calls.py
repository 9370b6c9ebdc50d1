"""How the engine runs a call that came over a link rather than through its own gRPC server: :class:`EngineCall`,
a stand-in for gRPC's servicer context, and :class:`EngineDispatch`, which finds the method's handler (through the
server's interceptors) and runs it (:mod:`splitfed.channel.engine.link`, :mod:`splitfed.channel.transports.direct.server`)."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from splitfed.channel.wire.framing import sizes_field, split_body

log = logging.getLogger(__name__)


class EngineCall:
    """What an aio handler sees of its call when it comes over a link (a stand-in for gRPC's context)."""

    def __init__(self, method: str, metadata: Sequence[tuple[str, str]], peer: str) -> None:
        self.method = method
        self._metadata = tuple((str(k), str(v)) for k, v in metadata)
        self._peer = peer
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._cancelled = False

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        self._code, self._details = code, details
        raise grpc.aio.AbortError()

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

    def cancelled(self) -> bool:
        return self._cancelled

    def time_remaining(self) -> float | None:
        return None

    def set_trailing_metadata(self, trailing_metadata: Any) -> None:
        """Trailing metadata does not cross the link."""

    def auth_context(self) -> dict[str, Any]:
        return {}


class _Handlers:
    """Collects generic handlers the way a gRPC server does (``add_*_handlers``), to look methods up."""

    def __init__(self) -> None:
        self.generic: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self.generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.generic.append(grpc.method_handlers_generic_handler(service, handlers))


@dataclass
class _Details:
    method: str
    invocation_metadata: tuple[tuple[str, str], ...]


@dataclass
class EngineDispatch:
    """Runs calls handed over by front-ends with the engine's own handlers (and interceptors)."""

    handlers: list[grpc.GenericRpcHandler]
    interceptors: list[Any] = field(default_factory=list)
    _chain: tuple[list[Any], Callable[[Any], Awaitable[Any]]] | None = field(default=None, init=False, repr=False)

    @classmethod
    def collecting(cls) -> tuple[EngineDispatch, _Handlers]:
        """A dispatch, and the stand-in server to register its handlers on (``add_XServicer_to_server(s, it)``)."""
        handlers = _Handlers()
        return cls(handlers.generic), handlers

    async def _lookup(self, details: Any) -> grpc.RpcMethodHandler | None:
        for h in self.handlers:
            found = h.service(details)
            if found is not None:
                return found
        return None

    def _handler(self, details: _Details) -> Awaitable[grpc.RpcMethodHandler | None]:
        """The method's handler, through the interceptors (their chain is built once, on the first call)."""
        chain = self._chain
        if chain is None or chain[0] is not self.interceptors:
            continuation: Callable[[Any], Awaitable[Any]] = self._lookup
            for interceptor in reversed(self.interceptors):
                continuation = functools.partial(interceptor.intercept_service, continuation)
            chain = self._chain = (self.interceptors, continuation)
        return chain[1](details)

    async def run(self, header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], list[bytes]]:
        """One call: the reply's header (its status) and its messages' bytes."""
        method = str(header.get("method", ""))
        call = EngineCall(method, [tuple(kv) for kv in header.get("md", [])], str(header.get("peer", "")))
        handler = await self._handler(_Details(method, call.invocation_metadata()))
        if handler is None:
            return {"code": grpc.StatusCode.UNIMPLEMENTED.name, "details": f"method {method} is not served"}, []
        streamed = handler.request_streaming or handler.response_streaming
        try:
            if streamed:
                messages = [handler.request_deserializer(m) if handler.request_deserializer else m
                            for m in split_body(body, sizes_field(header, len(body)))]

                async def requests() -> AsyncIterator[Any]:
                    for m in messages:
                        yield m
                behaviour = handler.stream_stream or handler.stream_unary or handler.unary_stream
                source: Any = requests() if handler.request_streaming else messages[0]
                result = behaviour(source, call)
                replies = [r async for r in result] if handler.response_streaming else [await result]
            else:
                request = handler.request_deserializer(body) if handler.request_deserializer else body
                replies = [await handler.unary_unary(request, call)]
        except grpc.aio.AbortError:
            pass
        except Exception as exc:  # noqa: BLE001 - the front-end answers with it; the engine keeps serving
            log.exception("a call handed over by a front-end failed")
            call.set_code(grpc.StatusCode.INTERNAL)
            call.set_details(f"internal error in the trunk server: {exc!r}")
        code = call.code()
        if code is not None and code is not grpc.StatusCode.OK:
            return {"code": code.name, "details": call.details()}, []
        serialize = handler.response_serializer
        return {"code": "OK", "parts": []}, [serialize(r) if serialize else r for r in replies]
