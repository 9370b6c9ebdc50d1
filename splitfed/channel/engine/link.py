"""The link between a trunk server's front-end processes and its engine: calls handed over a Unix socket.

A front-end (:mod:`splitfed.channel.engine.frontend`) takes gRPC calls in on the server's port and hands each one,
still as the bytes gRPC received, to the engine (the process that owns the trunks and their device). The
engine runs the call with the very handlers its own gRPC server would (the split channel's dispatch, the
admin service, health; :mod:`splitfed.channel.engine.calls`), and hands the reply's bytes back. gRPC's own
per-call work runs in the front-ends, on cores of their own; the engine's event loop only reads frames and runs the
handlers. :mod:`splitfed.channel.transports.direct.server` listens the same way for clients' direct calls.

The link carries frames (:mod:`splitfed.channel.wire.framing`, read by :mod:`splitfed.channel.wire.frameconn`), which
check every size and header once for all three socket links. A call's header carries its id, method, metadata,
peer and deadline; a streamed call's body holds all its messages, their sizes in the header; ``{"cancel": id}``
cancels a call in flight. Nothing is unpickled. The socket lies in a directory only the server's user can enter,
and a front-end proves itself with a random secret in its first frame (its hello) before its first call.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from splitfed.channel.engine.loop import own_task
from splitfed.channel.engine.calls import EngineDispatch
from splitfed.channel.wire.frameconn import FrameConnection, open_unix, serve_unix
from splitfed.channel.wire.limits import CLIENT_ID_KEY
from splitfed.channel.wire.framing import (
    HELLO_LIMITS,
    HELLO_TIMEOUT_S,
    FrameError,
    FrameLimits,
    LinkClosed,
    int_field,
    sizes_field,
    split_body,
)

log = logging.getLogger(__name__)

#: Methods whose requests and replies are streams.
STREAMED = frozenset({"ForwardStream", "BackwardStream"})


# -- the engine's side ------------------------------------------------------------------------------------------
_TIMEOUT: Callable[[float], Any] | None = getattr(asyncio, "timeout", None)


async def _within(work: Awaitable[Any], seconds: float) -> Any:
    """``work``'s result, or :class:`asyncio.TimeoutError` after ``seconds`` (``asyncio.timeout`` where there is one:
    it cancels the awaiting task itself, where ``wait_for`` before 3.12 ran ``work`` as a task of its own)."""
    if _TIMEOUT is None:  # Python 3.10
        return await asyncio.wait_for(work, seconds)
    async with _TIMEOUT(seconds):
        return await work


#: The methods :attr:`EngineListener.step_calls` counts.
STEP_METHODS = frozenset({"Forward", "Backward", "ForwardStream", "BackwardStream"})


def _client_of(metadata: Any) -> str:
    """The client id a call's metadata (``[[key, value], ...]``) names, or ''."""
    for pair in metadata if isinstance(metadata, (list, tuple)) else ():
        if isinstance(pair, (list, tuple)) and len(pair) == 2 and pair[0] == CLIENT_ID_KEY:
            return str(pair[1])
    return ""


class EngineListener:
    """The engine's end: accepts front-ends on a Unix socket and runs their calls with an :class:`EngineDispatch`."""

    def __init__(self, path: str, secret: str, dispatch: EngineDispatch, max_body: int) -> None:
        self.path = path
        self.secret = secret
        self.dispatch = dispatch
        self.max_body = max_body
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.stats: dict[str, int] = {"calls": 0, "front-ends": 0}
        #: Forward and Backward calls (unary or streamed) answered OK, by the client id their metadata names.
        self.step_calls: Counter[str] = Counter()

    async def start(self) -> None:
        """Listen (on the running event loop)."""
        self._server = await serve_unix(self.path, FrameLimits(self.max_body), self._connection, first=HELLO_LIMITS)

    async def stop(self) -> None:
        """Stop listening and cancel the calls in flight."""
        if self._server is not None:
            self._server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    #: Whether the calls in flight on a connection are cancelled when it closes (a front-end's are not: it
    #: answers them with the link's failure itself).
    cancel_on_close = False

    def admit(self, hello: dict[str, Any]) -> Any:
        """What a connection's first frame proves: None refuses the connection, anything else admits it and is
        handed to :meth:`bind` with each of its calls (a front-end: the secret)."""
        if not hmac.compare_digest(str(hello.get("secret", "")), self.secret):
            log.warning("a process without the front-ends' secret tried the engine link; closed")
            return None
        self.stats["front-ends"] += 1
        return True

    async def welcome(self, conn: FrameConnection) -> None:
        """Tell an admitted connection so, before its first call (a front-end is told nothing)."""

    def bind(self, header: dict[str, Any], admitted: Any) -> dict[str, Any] | None:
        """Make ``header`` the call an admitted connection may run (in place); a reply header (its status) to
        answer with instead, or None. A front-end's calls run as it hands them over."""
        return None

    async def _connection(self, conn: FrameConnection) -> None:
        calls: dict[int, asyncio.Task[Any]] = {}
        me = asyncio.current_task()
        if me is not None:
            self._tasks.add(me)  # stop() ends the connection too
        try:
            admitted = self.admit((await _within(conn.read(), HELLO_TIMEOUT_S))[0])
            if admitted is None:
                return
            await self.welcome(conn)
            # Each call starts in the protocol's callback as its frame is cut out: no task wakes to read it.
            conn.listen(lambda frame: self._take(frame, admitted, conn, calls))
            await conn.read()  # returns only at the link's end, raising
        except (LinkClosed, asyncio.TimeoutError) as exc:  # a malformed frame or id, or no hello in time
            if isinstance(exc, FrameError) or not isinstance(exc, LinkClosed):
                log.warning("engine link closed: %s", exc or "no first frame in time")
        finally:
            if self.cancel_on_close:
                for task in list(calls.values()):
                    task.cancel()
            conn.close()
            self._tasks.discard(me)  # type: ignore[arg-type]

    def _take(self, frame: tuple[dict[str, Any], Any], admitted: Any, conn: FrameConnection,
              calls: dict[int, asyncio.Task[Any]]) -> None:
        """Start the call a frame carries, or cancel the one it names (raises :class:`FrameError` for a malformed
        id, which closes the link)."""
        header, body = frame
        if header.get("cancel") is not None:
            task = calls.get(int_field(header, "cancel"))
            if task is not None:
                task.cancel()
            return
        call_id = int_field(header, "id")
        refusal = self.bind(header, admitted)
        # Started eagerly where asyncio can: the call runs up to its first wait within this callback.
        task = own_task(self._call(self._serve(call_id, header, body, conn, refusal), call_id, calls))
        if not task.done():
            calls[call_id] = task
            self._tasks.add(task)

    async def _call(self, serving: Awaitable[None], call_id: int, calls: dict[int, asyncio.Task[Any]]) -> None:
        """``serving``, then the call let go of (here, not in a done callback: one callback less per call)."""
        try:
            await serving
        finally:
            calls.pop(call_id, None)
            self._tasks.discard(asyncio.current_task())  # type: ignore[arg-type]

    async def _serve(self, call_id: int, header: dict[str, Any], body: bytes, conn: FrameConnection,
                     refusal: dict[str, Any] | None = None) -> None:
        self.stats["calls"] += 1
        deadline = header.get("timeout")
        try:
            if refusal is not None:
                reply, parts = refusal, []
            else:
                run = self.dispatch.run(header, body)
                reply, parts = await (_within(run, float(deadline)) if deadline else run)
        except asyncio.TimeoutError:
            reply, parts = {"code": grpc.StatusCode.DEADLINE_EXCEEDED.name, "details": "deadline exceeded"}, []
        except asyncio.CancelledError:
            reply, parts = {"code": grpc.StatusCode.CANCELLED.name, "details": "cancelled by the client"}, []
        if reply.get("code", "OK") == "OK" and str(header.get("method", "")).rsplit("/", 1)[-1] in STEP_METHODS:
            self.step_calls[_client_of(header.get("md"))] += 1
        reply["id"] = call_id
        reply["parts"] = [len(p) for p in parts]
        try:
            await conn.write(reply, parts)  # one frame in one write: replies of concurrent calls never interleave
        except ConnectionError:
            pass


# -- the front-end's side ---------------------------------------------------------------------------------------
class EngineLink:
    """A front-end's end: hands calls to the engine and awaits their replies."""

    def __init__(self, path: str, secret: str, max_body: int) -> None:
        self.path = path
        self.secret = secret
        self.max_body = max_body
        self._conn: FrameConnection | None = None
        self._pending: dict[int, asyncio.Future[tuple[dict[str, Any], bytes]]] = {}
        self._ids = itertools.count()
        self._reader_task: asyncio.Task[None] | None = None
        self.closed = asyncio.Event()

    async def connect(self) -> None:
        """Connect and prove this front-end with the secret."""
        self._conn = await open_unix(self.path, FrameLimits(self.max_body))
        await self._conn.write({"secret": self.secret})
        self._reader_task = asyncio.ensure_future(self._read(self._conn))

    async def _read(self, conn: FrameConnection) -> None:
        try:
            conn.listen(self._reply)  # each reply settles its call in the protocol's callback
            await conn.read()  # returns only at the link's end, raising
        except LinkClosed as exc:
            if isinstance(exc, FrameError):
                log.warning("the engine link closed: %s", exc)
        finally:
            conn.close()
            self.closed.set()
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(LinkClosed("the trunk server's engine went away"))
            self._pending.clear()

    def _reply(self, frame: tuple[dict[str, Any], Any]) -> None:
        header, body = frame
        future = self._pending.pop(int_field(header, "id"), None)
        if future is not None and not future.done():
            future.set_result((header, body))

    async def call(self, method: str, metadata: Sequence[tuple[str, str]], peer: str, messages: Sequence[bytes],
                   timeout: float | None) -> tuple[dict[str, Any], list[bytes]]:
        """Hand one call over: its reply's header and messages. Raises :class:`LinkClosed`."""
        conn = self._conn
        if conn is None or self.closed.is_set():
            raise LinkClosed("the trunk server's engine is not reachable")
        call_id = next(self._ids)
        future: asyncio.Future[tuple[dict[str, Any], bytes]] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        header: dict[str, Any] = {"id": call_id, "method": method, "md": [list(kv) for kv in metadata],
                                  "peer": peer, "timeout": timeout, "parts": [len(m) for m in messages]}
        try:
            await conn.write(header, messages)
            reply, body = await future
        except asyncio.CancelledError:
            self._pending.pop(call_id, None)
            if not self.closed.is_set():
                try:
                    await conn.write({"cancel": call_id})
                except LinkClosed:
                    pass
            raise
        except LinkClosed:
            self._pending.pop(call_id, None)
            raise
        return reply, split_body(body, sizes_field(reply, len(body)))

    async def close(self) -> None:
        """Close the link."""
        if self._conn is not None:
            self._conn.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
