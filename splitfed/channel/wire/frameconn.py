"""Frames (:mod:`splitfed.channel.wire.framing`) over an asyncio connection, read straight into their memory.

asyncio's ``StreamReader`` gathers what arrives in a buffer of its own, grows it, and copies each message out; a
MiB body is copied two or three times before a handler sees it. :class:`FrameConnection` is a buffered protocol
instead: small frames are read many at a time into one scratch buffer and cut out of it, and a frame whose body
does not fit the scratch buffer has its body read by the kernel straight into a buffer of its own (one copy in
all, the kernel's). Frames and checks are those of :mod:`splitfed.channel.wire.framing`: a frame above the limits or
with a malformed header closes the connection, and the reader gets :class:`~splitfed.channel.wire.framing.FrameError`.
A large body's buffer is allocated when its header arrives, so the limits bound what one peer makes this end hold;
a connection's first frame (its hello) is held to limits of its own (``first``: no body), so nothing is allocated
for a peer that has not proved itself.

One task reads a connection (:meth:`FrameConnection.read`), or the connection hands each frame to a callback as it
is cut out (:meth:`FrameConnection.listen`: no task wakes per frame); any number may write whole frames
(:meth:`FrameConnection.write` writes a frame in one call, so frames never interleave).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from typing import Any

from splitfed.channel.wire.framing import (
    LENGTHS,
    FrameError,
    FrameLimits,
    LinkClosed,
    Parts,
    decode_header,
    pieces,
    tune,
)

#: A frame of at most this many bytes in all is joined and written in one piece (one system call).
_JOIN_BELOW = 64 << 10
#: The scratch buffer small frames are read into.
SCRATCH_BYTES = 256 << 10
#: A writer waits for the socket to take its bytes only once this many are buffered (a frame's write does not).
DRAIN_ABOVE = 1 << 20

Frame = tuple[dict[str, Any], Any]


class FrameConnection(asyncio.BufferedProtocol):
    """One end of a connection that carries frames (see the module docstring).

    Args:
        limits: the largest frame this end accepts (change it with :attr:`limits` once a hello admitted the peer).
        on_open: called with the connection once it is made (a server's handler starts there).
        first: the limits of the first frame only (a hello: no peer sends a large frame before it is admitted).
    """

    def __init__(self, limits: FrameLimits, on_open: Callable[[FrameConnection], None] | None = None, *,
                 first: FrameLimits | None = None) -> None:
        self.limits = first or limits
        self._then = limits if first is not None else None
        self._on_open = on_open
        self.transport: asyncio.Transport | None = None
        self._scratch = bytearray(SCRATCH_BYTES)
        self._start = 0  # unparsed bytes of the scratch buffer: [start, end)
        self._end = 0
        self._head: dict[str, Any] | None = None  # a large frame's header, while its body arrives
        self._body: memoryview | None = None
        self._got = 0
        self._frames: collections.deque[Frame] = collections.deque()
        self._on_frame: Callable[[Frame], None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._error: LinkClosed | None = None
        self._drained: asyncio.Future[None] | None = None
        self.closed = asyncio.Event()

    # -- the protocol's side ---------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            tune(sock)
        if self._on_open is not None:
            self._on_open(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is not None:
            return self._body[self._got:]
        if self._end == len(self._scratch):
            self._compact()
        return memoryview(self._scratch)[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._body is not None:
                self._got += nbytes
                if self._got == len(self._body):
                    assert self._head is not None
                    frame = (self._head, self._body.obj)
                    self._head, self._body = None, None
                    self._deliver(frame)
                return
            self._end += nbytes
            self._parse()
        except FrameError as exc:  # a frame above the limits, a malformed header, or one a listener refused
            self._fail(exc)
            if self.transport is not None:
                self.transport.close()

    def _compact(self) -> None:
        """Move the unparsed bytes to the scratch buffer's start (growing it for a header that does not fit)."""
        held = self._end - self._start
        need = held + 1
        if held >= LENGTHS.size:  # the frame's header, and its body unless that is read into its own buffer
            head_len, body_len = LENGTHS.unpack_from(self._scratch, self._start)
            need = LENGTHS.size + head_len + (body_len if body_len <= len(self._scratch) // 2 else 0)
        if need > len(self._scratch):
            grown = bytearray(need + SCRATCH_BYTES)
            grown[:held] = self._scratch[self._start:self._end]
            self._scratch = grown
        else:
            self._scratch[:held] = self._scratch[self._start:self._end]
        self._start, self._end = 0, held

    def _parse(self) -> None:
        buf = self._scratch
        while self._end - self._start >= LENGTHS.size:
            at, held = self._start, self._end - self._start
            head_len, body_len = LENGTHS.unpack_from(buf, at)
            self.limits.check(head_len, body_len)
            if held < LENGTHS.size + head_len:
                return  # the header is still coming
            size = LENGTHS.size + head_len + body_len
            if held >= size:
                header = decode_header(memoryview(buf)[at + LENGTHS.size: at + LENGTHS.size + head_len])
                self._deliver((header, bytes(buf[at + LENGTHS.size + head_len: at + size])))
                self._start += size
                continue
            if size > len(buf) - at and body_len > len(buf) // 2:  # a large body: read it into its own buffer
                header = decode_header(memoryview(buf)[at + LENGTHS.size: at + LENGTHS.size + head_len])
                body = bytearray(body_len)
                have = held - LENGTHS.size - head_len
                body[:have] = buf[at + LENGTHS.size + head_len: self._end]
                self._head, self._body, self._got = header, memoryview(body), have
                self._start = self._end = 0
                return
            if size > len(buf) - at:
                self._compact()
                buf = self._scratch
            return
        if self._start == self._end:
            self._start = self._end = 0

    def _deliver(self, frame: Frame) -> None:
        if self._then is not None:  # the hello came: the link's own limits from now on
            self.limits, self._then = self._then, None
        if self._on_frame is not None:
            self._on_frame(frame)
            return
        self._frames.append(frame)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: LinkClosed) -> None:
        self._on_frame = None  # a listener that holds this connection would keep it (and its buffers) in a cycle
        if self._error is None:
            self._error = error
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _raised(self) -> LinkClosed:
        """The error that closed the link, as a new exception each time it is raised: raised itself, its
        traceback would hold the raising frame and with it this connection (its buffers), which holds the error,
        a cycle that only a garbage collection frees."""
        assert self._error is not None
        return type(self._error)(*self._error.args)

    def eof_received(self) -> bool:
        inside = self._body is not None or self._end > self._start
        self._fail(LinkClosed("the stream ended inside a frame" if inside else "the peer closed the link"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(LinkClosed(f"the connection was lost ({exc})" if exc else "the peer closed the link"))
        self.closed.set()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def pause_writing(self) -> None:
        if self._drained is None or self._drained.done():
            self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # -- the user's side -------------------------------------------------------------------------------------
    async def read(self) -> Frame:
        """The next frame: its header and its body (``bytes``, or a ``bytearray`` for a large one). Raises
        :class:`LinkClosed` once the connection closed, :class:`FrameError` after a frame this end refused."""
        while not self._frames:
            if self._error is not None:
                raise self._raised()
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._frames.popleft()

    def listen(self, on_frame: Callable[[Frame], None]) -> None:
        """Hand every frame from now on (those already arrived first) to ``on_frame``, called in the protocol's
        own callback as the frame is cut out: no task wakes per frame. ``on_frame`` must not block; a
        :class:`FrameError` it raises closes the connection as a malformed frame does. :meth:`read` then returns only
        at the link's end, raising its :class:`LinkClosed`."""
        while self._frames:
            on_frame(self._frames.popleft())
        self._on_frame = on_frame

    async def write(self, header: dict[str, Any], parts: Parts = ()) -> None:
        """Send one frame (``parts`` concatenated as its body); raises :class:`LinkClosed` when the connection is
        gone (the :class:`FrameError` that closed it, if one did)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            raise self._raised() if self._error is not None else LinkClosed("the link is closed")
        out = pieces(header, parts)
        if sum(len(p) for p in out) <= _JOIN_BELOW:
            transport.write(b"".join(out))
        else:  # each piece from its own memory: the transport sends what it can at once, copying only the rest
            transport.write(out[0] + out[1])
            for part in out[2:]:
                transport.write(part)
        if transport.get_write_buffer_size() > DRAIN_ABOVE and self._drained is not None \
                and not self._drained.done():
            await self._drained

    def close(self) -> None:
        """Close the connection (what is still buffered is sent first)."""
        if self.transport is not None:
            self.transport.close()


async def serve_unix(path: str, limits: FrameLimits, handle: Callable[[FrameConnection], Awaitable[None]], *,
                     first: FrameLimits | None = None) -> asyncio.AbstractServer:
    """Listen on the Unix socket ``path``; each connection is handed to ``handle`` (as a task of its own), its
    first frame held to ``first`` (a hello's limits) and the others to ``limits``."""
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()

    def opened(conn: FrameConnection) -> None:
        task = loop.create_task(handle(conn))
        tasks.add(task)  # held until done (the loop keeps only a weak reference)
        task.add_done_callback(tasks.discard)
    return await loop.create_unix_server(lambda: FrameConnection(limits, opened, first=first), path=path)


async def open_unix(path: str, limits: FrameLimits) -> FrameConnection:
    """A connection to the Unix socket ``path``."""
    _, conn = await asyncio.get_running_loop().create_unix_connection(lambda: FrameConnection(limits), path=path)
    return conn


__all__ = ["DRAIN_ABOVE", "SCRATCH_BYTES", "FrameConnection", "open_unix", "serve_unix"]
