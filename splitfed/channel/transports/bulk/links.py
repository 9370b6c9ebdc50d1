"""Bulk links: the tensor bytes of streamed calls over plain TCP connections beside the gRPC channel.

Python gRPC moves a large message at a fraction of what the socket beneath it can: each chunk is copied into a
message, framed, and gathered again (about 7-9 ms each way for 12.6 MB over loopback, against 4 ms for one raw TCP
connection and under 2 ms for four). A bulk link is ``n`` TCP connections between one client and the trunk
server; a streamed call then sends only its header frame over gRPC, with a :class:`BulkRef` naming the transfer,
and the header's tensor bytes go over the link's connections at once, one stripe each, written from and read
into the memory they live in (pinned memory on a GPU's side: no copy of their own). The reply comes back the same
way under the same transfer number.

A connection carries frames (:mod:`splitfed.channel.wire.framing`, the stream protocol of every socket link): first
its hello (:func:`hello`: the protocol, the ticket and the connection's index; see
:mod:`splitfed.channel.transports.bulk.hub`), answered by :data:`ADMITTED`, then segments, each a frame whose header names the
transfer, its total bytes and the segment's offset (:func:`segment`, an integer header: a link sends many) and whose body is the segment's bytes, read
straight into the transfer's buffer. A transfer of ``total`` bytes is cut into the stripes :func:`stripes` gives;
connection ``i`` carries stripe ``i`` and nothing else. Sizes and headers are checked by the framing; beyond them
a receiver refuses (and closes the link on) a segment that is not exactly its connection's stripe, a stripe sent
twice, a transfer larger than it accepts, more bytes pending than it holds, or a total that disagrees with the
transfer's other stripes: no byte of a transfer is ever left unwritten, so no buffer is handed over holding what a
pooled buffer held before.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from splitfed.channel.wire.framing import (
    HELLO_LIMITS,
    FrameLimits,
    IntHeader,
    recv_frame,
    recv_head,
    recv_into,
    send_frame,
    tune,
)
from splitfed.errors import BulkLinkError

if TYPE_CHECKING:
    from splitfed.channel.security.bulktls import BulkTLS

log = logging.getLogger(__name__)

#: What a connection's hello names first: a bulk link's connection, this version of it.
PROTOCOL = "splitfed-bulk/2"
TICKET_BYTES = 32
#: The server's answer once a connection is attached.
ADMITTED = {"admitted": True}
#: A segment frame's header (an :class:`~splitfed.channel.wire.framing.IntHeader`: a link sends many).
SEGMENT = IntHeader("transfer", "total", "offset")
#: A transfer is cut into at most one stripe per connection, each at least this large.
MIN_STRIPE_BYTES = 256 << 10
#: Above this many bytes a client with a bulk link streams its calls over it, whatever its unary threshold.
BULK_MIN_BYTES = 256 << 10
#: A transfer nobody took within this long is dropped (its sender's call has failed or moved on).
TRANSFER_TTL_S = 120.0
#: Taken transfers whose ids a link remembers, so that a call naming one again fails at once instead of waiting for
#: bytes that went to an earlier attempt.
TAKEN_KEPT = 4096


def stripes(total: int, connections: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each connection's stripe of a transfer of ``total`` bytes (connection ``i``
    carries ``stripes(...)[i]``; connections past the list carry nothing of it)."""
    if total <= 0:
        return []
    count = max(1, min(connections, total // MIN_STRIPE_BYTES))
    size = -(-total // count)
    return [(start, min(size, total - start)) for start in range(0, total, size)]


def hello(ticket: bytes, index: int) -> dict[str, object]:
    """The first frame of a link's connection ``index``: the protocol and the link's ticket."""
    return {"protocol": PROTOCOL, "ticket": ticket.hex(), "index": index}


def segment(transfer: int, total: int, offset: int) -> bytes:
    """The header of a segment frame: bytes ``offset..`` (the frame's body) of ``transfer``, ``total`` in all."""
    return SEGMENT.encode(transfer, total, offset)


def _settle(future: concurrent.futures.Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    """Complete ``future`` unless it already is (a transfer's bytes and its taker's giving up may cross)."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass


def _numpy_bytes(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


class _Transfer:
    __slots__ = ("buf", "created", "done", "parts", "seen", "total")

    def __init__(self, buf: np.ndarray, total: int, parts: int) -> None:
        self.buf = buf
        self.total = total
        self.parts = parts
        self.seen = 0  # bit i: stripe i came
        self.done: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()
        self.created = time.monotonic()


class BulkLink:
    """One end of a bulk link: ``socks`` (connected, handshaken) in index order.

    Args:
        name: the link's name (what :class:`BulkRef` messages carry).
        socks: the connections, connection ``i`` at index ``i``.
        out_socks: the connections this end writes to, when they are others than those it reads from (a TLS
            link: see :mod:`splitfed.channel.security.bulktls`); ``socks`` by default.
        alloc: what an incoming transfer's bytes are read into (a writable uint8 array of exactly the bytes
            asked; pinned memory, say, for bytes bound for a GPU); numpy's memory by default.
        max_bytes: the largest transfer this end takes.
        max_pending_bytes: bytes of transfers received or arriving but not yet taken, at most.
        on_close: called once the link closed, with the reason.
    """

    def __init__(self, name: str, socks: Sequence[socket.socket], *, out_socks: Sequence[socket.socket] | None = None,
                 alloc: Callable[[int], np.ndarray] | None = None, max_bytes: int = 1 << 30,
                 max_pending_bytes: int = 4 << 30, on_close: Callable[[BulkLink, str], None] | None = None) -> None:
        if not socks or (out_socks is not None and not out_socks):
            raise ValueError("a bulk link needs at least one connection each way")
        self.name = name
        self.socks = list(socks)
        self.out_socks = list(socks if out_socks is None else out_socks)
        self.alloc = alloc or _numpy_bytes
        self.max_bytes = int(max_bytes)
        self.max_pending_bytes = int(max_pending_bytes)
        self._on_close = on_close
        self._lock = threading.Lock()
        self._transfers: dict[int, _Transfer] = {}
        self._pending = 0
        #: Transfers taken lately (each id is used once: a call that names one again is a replay of its header).
        self._taken: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._ids = itertools.count(1)
        self._senders = [concurrent.futures.ThreadPoolExecutor(1, f"splitfed-bulk-send-{i}")
                         for i in range(len(self.out_socks))]
        self._readers = [threading.Thread(target=self._read, args=(i,), name=f"splitfed-bulk-read-{i}", daemon=True)
                         for i in range(len(self.socks))]
        self.closed: str | None = None
        #: Payload bytes sent and received over the link.
        self.bytes_sent = 0
        self.bytes_received = 0

    def start(self) -> BulkLink:
        """Start reading its connections; returns self."""
        for thread in self._readers:
            thread.start()
        return self

    @property
    def connections(self) -> int:
        """How many connections the link reads from (as many as it writes to)."""
        return len(self.socks)

    def next_transfer(self) -> int:
        """A transfer number not used before on this link (the client numbers its calls)."""
        return next(self._ids)

    # -- sending ---------------------------------------------------------------------------------------------
    def send(self, transfer: int, parts: Sequence[memoryview], total: int) -> list[concurrent.futures.Future[None]]:
        """Send the bytes of ``parts`` (``total`` in all, in order) as ``transfer``, one stripe per connection,
        each on its connection's sending thread; the futures complete once each stripe is written. ``parts``
        must stay alive and unchanged until then."""
        if self.closed is not None:
            raise BulkLinkError(f"bulk link {self.name} is closed: {self.closed}")
        views = [p if isinstance(p, memoryview) and p.format == "B" and p.ndim == 1 else memoryview(p).cast("B")
                 for p in parts]
        if sum(len(v) for v in views) != total:
            raise ValueError(f"parts hold {sum(len(v) for v in views)} bytes, not {total}")
        futures = []
        for index, (offset, length) in enumerate(stripes(total, len(self.out_socks))):
            pieces, start = [], 0
            for view in views:
                lo, hi = max(offset, start), min(offset + length, start + len(view))
                if lo < hi:
                    pieces.append(view[lo - start:hi - start])
                start += len(view)
            futures.append(self._senders[index].submit(self._write, index, segment(transfer, total, offset),
                                                       pieces))
        return futures

    def _write(self, index: int, header: bytes, pieces: list[memoryview]) -> None:
        sock = self.out_socks[index]
        try:
            send_frame(sock, header, pieces)
        except OSError as exc:
            self.close(f"sending on connection {index} failed: {exc}")
            raise BulkLinkError(f"bulk link {self.name}: sending failed ({exc})") from None
        with self._lock:
            self.bytes_sent += sum(len(p) for p in pieces)

    # -- receiving -------------------------------------------------------------------------------------------
    def _entry(self, transfer: int, total: int) -> _Transfer:
        """The transfer's entry, made (its buffer allocated) when it is new; raises :class:`BulkLinkError` for a
        total that disagrees or does not fit."""
        with self._lock:
            entry = self._transfers.get(transfer)
            if entry is not None:
                if entry.total != total:
                    raise BulkLinkError(f"transfer {transfer} declared {entry.total} bytes, then {total}")
                return entry
            if total <= 0 or total > self.max_bytes:
                raise BulkLinkError(f"transfer {transfer} declares {total} bytes; this end takes 1 to "
                                    f"{self.max_bytes}")
            self._expire(time.monotonic())
            if self._pending + total > self.max_pending_bytes:
                raise BulkLinkError(f"transfer {transfer} of {total} bytes would hold more than "
                                    f"{self.max_pending_bytes} bytes not yet taken")
            self._pending += total
        buf = self.alloc(total)
        if len(buf) != total:
            raise ValueError(f"alloc gave {len(buf)} bytes for {total}")
        entry = _Transfer(buf, total, len(stripes(total, len(self.socks))))
        with self._lock:
            raced = self._transfers.setdefault(transfer, entry)
            if raced is not entry:
                self._pending -= total
        return raced

    def _expire(self, now: float) -> None:
        """Drop transfers older than :data:`TRANSFER_TTL_S` (holding the lock)."""
        for transfer, entry in list(self._transfers.items()):
            if now - entry.created > TRANSFER_TTL_S:
                del self._transfers[transfer]
                self._pending -= entry.total
                _settle(entry.done, error=BulkLinkError(f"transfer {transfer} was not taken within "
                                                        f"{TRANSFER_TTL_S:.0f}s"))

    def _read(self, index: int) -> None:
        sock, limits = self.socks[index], FrameLimits(max_body=self.max_bytes, max_header=64)
        try:
            while (got := recv_head(sock, limits, SEGMENT)) is not None:
                (transfer, total, offset), length = got
                expected = stripes(total, len(self.socks))
                if index >= len(expected) or expected[index] != (offset, length):
                    raise BulkLinkError(f"connection {index} sent bytes {offset}..{offset + length} of transfer "
                                        f"{transfer}; its stripe of {total} bytes is "
                                        f"{expected[index] if index < len(expected) else 'empty'}")
                entry = self._entry(transfer, total)
                with self._lock:
                    if entry.seen & (1 << index):
                        raise BulkLinkError(f"connection {index} sent its stripe of transfer {transfer} twice")
                    entry.seen |= 1 << index
                recv_into(sock, memoryview(entry.buf)[offset:offset + length])
                with self._lock:
                    self.bytes_received += length
                    entry.parts -= 1
                    complete = entry.parts == 0
                if complete:
                    _settle(entry.done, entry.buf)
            self.close(f"connection {index} closed by the peer")
        except Exception as exc:  # noqa: BLE001 - a reader never ends without closing its link
            if self.closed is None:
                log.warning("bulk link %s: %s; closing it", self.name, exc)
            self.close(str(exc))

    def pending(self, transfer: int, total: int) -> concurrent.futures.Future[np.ndarray]:
        """The future of ``transfer``'s bytes (``total`` of them; the buffer is allocated now if none of its bytes
        came yet); :meth:`taken` must follow, whatever happens."""
        if self.closed is not None:
            raise BulkLinkError(f"bulk link {self.name} is closed: {self.closed}")
        with self._lock:
            replayed = transfer in self._taken
        if replayed:  # e.g. gRPC retried the call's header on its own: its bytes went to the first attempt
            raise BulkLinkError(f"transfer {transfer} of bulk link {self.name} was taken by an earlier attempt of its "
                                "call; a retry sends its bytes again, in a new transfer or over gRPC")
        try:
            return self._entry(transfer, total).done
        except BulkLinkError as exc:
            self.close(str(exc))
            raise

    def taken(self, transfer: int) -> None:
        """Forget ``transfer`` (its bytes were handed over, or its call gave up on them)."""
        with self._lock:
            entry = self._transfers.pop(transfer, None)
            if entry is not None:
                self._pending -= entry.total
            self._taken[transfer] = None
            while len(self._taken) > TAKEN_KEPT:
                self._taken.popitem(last=False)
        if entry is not None:
            _settle(entry.done, error=BulkLinkError(f"transfer {transfer} was given up"))

    def take(self, transfer: int, total: int, timeout: float | None) -> np.ndarray:
        """Wait (at most ``timeout`` seconds) for ``transfer``'s ``total`` bytes; raises :class:`BulkLinkError`
        when they do not come."""
        try:
            return self.pending(transfer, total).result(timeout)
        except concurrent.futures.TimeoutError:
            raise BulkLinkError(f"transfer {transfer} of bulk link {self.name} did not arrive within "
                                f"{timeout:.1f}s") from None
        finally:
            self.taken(transfer)

    # -- closing ---------------------------------------------------------------------------------------------
    def close(self, why: str = "closed") -> None:
        """Close every connection and fail what waits on the link (idempotent)."""
        with self._lock:
            if self.closed is not None:
                return
            self.closed = why
            waiting = list(self._transfers.values())
            self._transfers.clear()
            self._pending = 0
        for sock in dict.fromkeys([*self.socks, *self.out_socks]):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        for sender in self._senders:
            sender.shutdown(wait=False, cancel_futures=True)
        for entry in waiting:
            _settle(entry.done, error=BulkLinkError(f"bulk link {self.name} closed: {why}"))
        if self._on_close is not None:
            self._on_close(self, why)


def connect(host: str, port: int, ticket: bytes, connections: int, *, timeout: float = 5.0,
            tls: BulkTLS | None = None) -> list[socket.socket]:
    """Open a link's ``connections`` to ``host:port`` and hand each the ``ticket`` and its index; returns them
    once the server attached every one. With ``tls``, twice as many, each a TLS connection that verified the
    server's certificate before the ticket goes (one direction each: see :mod:`splitfed.channel.security.bulktls`).
    Raises :class:`BulkLinkError` (closing what opened) otherwise."""
    socks: list[socket.socket] = []
    try:
        for index in range(connections * (2 if tls is not None else 1)):
            sock = socket.create_connection((host, port), timeout=timeout)
            socks.append(sock)
            tune(sock)
            if tls is not None:
                sock = tls.context.wrap_socket(sock, server_hostname=tls.server_name or host.strip("[]"))
                socks[-1] = sock
            send_frame(sock, hello(ticket, index))
        for index, sock in enumerate(socks):
            if recv_frame(sock, HELLO_LIMITS)[0] != ADMITTED:
                raise BulkLinkError(f"the server refused bulk connection {index}")
            sock.settimeout(None)
    except (OSError, BulkLinkError) as exc:
        for sock in socks:
            sock.close()
        raise BulkLinkError(f"bulk connections to {host}:{port} failed: {exc}") from None
    return socks


__all__ = ["ADMITTED", "BULK_MIN_BYTES", "PROTOCOL", "BulkLink", "BulkLinkError", "connect", "hello", "segment",
           "stripes"]
