"""The one stream protocol of the split channel's socket links: framed messages over a byte stream.

Three links carry frames: the bulk links' TCP connections (:mod:`splitfed.channel.transports.bulk.links`), the direct calls over the
engine's Unix socket (:mod:`splitfed.channel.transports.direct.server`, :mod:`splitfed.channel.transports.direct.client`) and the link between
the front-end processes and the engine (:mod:`splitfed.channel.engine.link`). All of them read and write frames
here, and every check of what a peer sent that does not depend on the link happens here, once.

A frame is ``!II`` (the header's bytes, the body's bytes), a header, and the body's bytes. A header is a JSON object
(UTF-8), or, for a link's hot frames (a bulk link's stripes), an :class:`IntHeader`: a zero byte and fixed unsigned
64-bit integers, read in a microsecond where a small JSON object takes several. Nothing is unpickled. A connection's first frame is its hello (what admits it: a secret, a ticket), sent
within :data:`HELLO_TIMEOUT_S`; what follows depends on the link (a call and its reply, a bulk stripe).

What a reader refuses, raising :class:`FrameError` (a :class:`LinkClosed`: the link is closed on it): a header or
body above its :class:`FrameLimits`, a header that is not a JSON object, a field of the wrong type or out of range
(:func:`int_field`, :func:`str_field`); a stream that ends inside a frame raises :class:`LinkClosed` (truncated),
one that ends between frames ends the reading quietly. Both blocking sockets (threads, which sleep in the kernel
without the GIL) and asyncio streams are served, with the same frames and the same checks.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: A frame's first bytes: the header's and the body's lengths.
LENGTHS = struct.Struct("!II")
#: The largest header a side accepts (call metadata is small; a larger one is a broken or hostile peer).
MAX_HEADER_BYTES = 1 << 20
#: Seconds a connection has to send its first frame (the secret or ticket that admits it).
HELLO_TIMEOUT_S = 10.0
#: Socket buffers asked for on a TCP connection that carries large bursts.
SOCKET_BUFFER_BYTES = 4 << 20
#: A frame with at most this many bytes in all is joined and sent in one piece (one system call).
_JOIN_BELOW = 64 << 10
#: An asyncio writer waits for the socket to take its bytes only once this many are buffered.
_DRAIN_ABOVE = 1 << 20
#: An asyncio reader reads a frame whose body is at most this many bytes with its header, in one piece.
_READ_WHOLE_BELOW = 64 << 10

Parts = Sequence[bytes | bytearray | memoryview]
#: A header as a caller gives it: a dict (written as JSON) or bytes already encoded (an :class:`IntHeader`'s).
Header = dict[str, Any] | bytes


class LinkClosed(ConnectionError):
    """The other end of the link went away (or sent what closes it: :class:`FrameError`)."""


class FrameError(LinkClosed):
    """The peer sent a frame this end refuses (above its limits, a malformed header, a field of the wrong type);
    the link is closed. A peer of this version never sends one: look for a client or server of another version, or
    something else on the link's port."""


@dataclass(frozen=True)
class FrameLimits:
    """The largest frame a reader accepts: ``max_header`` header bytes, ``max_body`` body bytes."""

    max_body: int
    max_header: int = MAX_HEADER_BYTES

    def check(self, head_len: int, body_len: int) -> None:
        """Raise :class:`FrameError` when a frame of these sizes is above the limits."""
        if head_len > self.max_header or body_len > self.max_body:
            raise FrameError(f"a frame of {head_len} + {body_len} bytes is above this end's limits "
                             f"({self.max_header} + {self.max_body})")


#: What a hello frame may be: a small header, no body.
HELLO_LIMITS = FrameLimits(max_body=0, max_header=4 << 10)


# -- headers ----------------------------------------------------------------------------------------------------
def encode_header(header: dict[str, Any]) -> bytes:
    """A header's bytes."""
    return json.dumps(header, separators=(",", ":")).encode()


def decode_header(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    """A header from its bytes; raises :class:`FrameError` unless they are a JSON object."""
    try:
        header = json.loads(bytes(data) if isinstance(data, memoryview) else data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FrameError(f"a frame's header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise FrameError(f"a frame's header is a JSON {type(header).__name__}, not an object")
    return header


class IntHeader:
    """A header of fixed integer fields (``fields``, in order): a zero byte, then each as an unsigned 64-bit
    little-endian integer. For frames a link sends many of and whose fields never change (a bulk link's stripes)."""

    def __init__(self, *fields: str) -> None:
        self.fields = fields
        self._struct = struct.Struct(f"<B{len(fields)}Q")
        #: The header's bytes.
        self.size = self._struct.size

    def encode(self, *values: int) -> bytes:
        """The header's bytes for ``values`` (one for each field, each in 0..2**64-1)."""
        return self._struct.pack(0, *values)

    def decode(self, data: bytes | bytearray | memoryview) -> tuple[int, ...]:
        """The fields' values; raises :class:`FrameError` for bytes that are not such a header."""
        if len(data) != self._struct.size or data[0] != 0:
            raise FrameError(f"a frame's header is not the {len(data)}-byte header of fields {', '.join(self.fields)}"
                             f" ({self._struct.size} bytes, a zero byte first)")
        return self._struct.unpack(data)[1:]


def int_field(header: dict[str, Any], key: str, *, lo: int = 0, hi: int = (1 << 63) - 1,
              default: int | None = None) -> int:
    """``header[key]`` as an integer in ``lo..hi``; ``default`` when it is absent and there is one. Raises
    :class:`FrameError` otherwise (a bool, a float, a string or a number out of range is refused)."""
    value = header.get(key, default)
    if type(value) is not int or not lo <= value <= hi:
        raise FrameError(f"a frame's {key!r} must be an integer in {lo}..{hi}, got {str(value)[:40]!r}")
    return value


def str_field(header: dict[str, Any], key: str, *, max_len: int = 4096, default: str | None = None) -> str:
    """``header[key]`` as a string of at most ``max_len`` characters; raises :class:`FrameError` otherwise."""
    value = header.get(key, default)
    if not isinstance(value, str) or len(value) > max_len:
        raise FrameError(f"a frame's {key!r} must be a string of at most {max_len} characters, got "
                         f"{str(value)[:40]!r}")
    return value


def sizes_field(header: dict[str, Any], body_len: int, key: str = "parts") -> list[int]:
    """``header[key]``: the sizes of the messages in a body of ``body_len`` bytes, which they must fill exactly.
    Raises :class:`FrameError` otherwise."""
    sizes = header.get(key, [])
    if not isinstance(sizes, list) or any(type(s) is not int or s < 0 for s in sizes) or sum(sizes) != body_len:
        raise FrameError(f"a frame's {key!r} must be the sizes of its messages, adding up to its {body_len} bytes")
    return sizes


def split_body(body: bytes | bytearray | memoryview, sizes: Sequence[int]) -> list[bytes]:
    """The messages of a body cut by ``sizes`` (checked with :func:`sizes_field`)."""
    view, out, at = memoryview(body), [], 0
    for size in sizes:
        out.append(bytes(view[at: at + size]))
        at += size
    return out


def pieces(header: Header, parts: Parts = ()) -> list[Any]:
    """A frame's bytes, as pieces to write in order (``parts`` concatenated are the body; not copied)."""
    head = header if isinstance(header, bytes) else encode_header(header)
    return [LENGTHS.pack(len(head), sum(len(p) for p in parts)), head, *parts]


# -- blocking sockets -------------------------------------------------------------------------------------------
def tune(sock: Any, buffer_bytes: int = SOCKET_BUFFER_BYTES) -> None:
    """Large buffers (a MiB frame goes in one system call, not one a default buffer's 208 KiB) and, on TCP, no
    Nagle delay: a link carries large bursts and waits for its replies."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, buffer_bytes)
        except OSError:  # a kernel that caps buffers keeps its own size
            pass


def send_frame(sock: socket.socket, header: Header, parts: Parts = ()) -> None:
    """Write one frame (``parts`` concatenated as its body) from the memory they live in."""
    out = pieces(header, parts)
    if sum(len(p) for p in out) <= _JOIN_BELOW:
        sock.sendall(b"".join(out))
        return
    sock.sendall(out[0] + out[1])
    for part in out[2:]:
        sock.sendall(part)


def recv_into(sock: socket.socket, view: memoryview, *, started: bool = True) -> bool:
    """Fill ``view`` from ``sock``. False when the peer closed before its first byte and ``started`` is False (the
    end between frames); raises :class:`LinkClosed` when it closed in the middle (a truncated frame)."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0 and not started:
                return False
            raise LinkClosed(f"the peer closed the connection after {got} of {n} bytes of a frame")
        got += k
    return True


def recv_head(sock: socket.socket, limits: FrameLimits, ints: IntHeader | None = None) -> tuple[Any, int] | None:
    """A frame's header (a JSON object; with ``ints``, that :class:`IntHeader`'s values, the lengths and the header
    read in one piece) and the length of the body that follows (read it with :func:`recv_into`); None when the peer
    closed the connection between frames."""
    if ints is not None:
        buf = bytearray(LENGTHS.size + ints.size)
        if not recv_into(sock, memoryview(buf), started=False):
            return None
        head_len, body_len = LENGTHS.unpack_from(buf)
        limits.check(head_len, body_len)
        if head_len != ints.size:
            raise FrameError(f"a frame's header of {head_len} bytes is not the {ints.size}-byte header of fields "
                             f"{', '.join(ints.fields)}")
        return ints.decode(memoryview(buf)[LENGTHS.size:]), body_len
    sizes = bytearray(LENGTHS.size)
    if not recv_into(sock, memoryview(sizes), started=False):
        return None
    head_len, body_len = LENGTHS.unpack(sizes)
    limits.check(head_len, body_len)
    head = bytearray(head_len)
    recv_into(sock, memoryview(head))
    return decode_header(head), body_len


def recv_frame(sock: socket.socket, limits: FrameLimits) -> tuple[dict[str, Any], memoryview]:
    """One whole frame: its header and a view of its body (header and body read in one piece after the lengths).
    Raises :class:`LinkClosed` when the peer closed the connection."""
    sizes = bytearray(LENGTHS.size)
    if not recv_into(sock, memoryview(sizes), started=False):
        raise LinkClosed("the peer closed the connection")
    head_len, body_len = LENGTHS.unpack(sizes)
    limits.check(head_len, body_len)
    frame = memoryview(bytearray(head_len + body_len))
    recv_into(sock, frame)
    return decode_header(frame[:head_len]), frame[head_len:]


# -- asyncio streams --------------------------------------------------------------------------------------------
async def write_frame(writer: asyncio.StreamWriter, header: dict[str, Any], parts: Parts = ()) -> None:
    """Write one frame (``parts`` concatenated as its body) to an asyncio stream."""
    # One write for the frame: one system call (a ``sendmsg`` of its pieces on Python 3.12+) rather than one a piece.
    writer.writelines(pieces(header, parts))
    if writer.transport.get_write_buffer_size() > _DRAIN_ABOVE:
        await writer.drain()


async def read_frame(reader: asyncio.StreamReader, limits: FrameLimits) -> tuple[dict[str, Any], bytes]:
    """One frame from an asyncio stream; raises :class:`LinkClosed` at the end of the stream, :class:`FrameError`
    for a frame this end refuses."""
    try:
        sizes = await reader.readexactly(LENGTHS.size)
        head_len, body_len = LENGTHS.unpack(sizes)
        limits.check(head_len, body_len)
        if body_len <= _READ_WHOLE_BELOW:  # a small frame in one read (the slice's copy costs less than a turn)
            frame = await reader.readexactly(head_len + body_len)
            return decode_header(memoryview(frame)[:head_len]), frame[head_len:]
        header = decode_header(await reader.readexactly(head_len))
        return header, await reader.readexactly(body_len)
    except asyncio.IncompleteReadError as exc:
        raise LinkClosed(f"the stream ended inside a frame ({len(exc.partial)} of {exc.expected} bytes)" if
                         exc.partial else "the peer closed the link") from None
    except FrameError:
        raise
    except ConnectionError as exc:
        raise LinkClosed(str(exc)) from None


__all__ = ["HELLO_LIMITS", "HELLO_TIMEOUT_S", "LENGTHS", "MAX_HEADER_BYTES", "FrameError", "FrameLimits",
           "IntHeader", "LinkClosed", "decode_header", "encode_header", "int_field", "pieces", "read_frame", "recv_frame",
           "recv_head", "recv_into", "send_frame", "sizes_field", "split_body", "str_field", "tune", "write_frame"]
