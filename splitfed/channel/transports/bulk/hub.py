"""The trunk server's bulk links: one listening port, tickets handed out by ``OpenBulk``, links by client.

A client asks for a link over its (authenticated) gRPC channel; :meth:`BulkHub.offer` answers with a link name,
a one-time ticket and the port. The client then opens the link's connections and sends, on each, a hello frame
(:func:`splitfed.channel.transports.bulk.links.hello`: the protocol, the ticket and the connection's index); the hub attaches each
connection to the ticket's link (answering :data:`~splitfed.channel.transports.bulk.links.ADMITTED`) and starts the link once all
are there. A link belongs to the identity that asked for it: a streamed
call of any other identity that names it is refused. A ticket not used within :data:`TICKET_TTL_S` lapses;
handshakes that do not complete within :data:`HANDSHAKE_TIMEOUT_S` are dropped; a link whose connection closes is
forgotten. Links are offered on plaintext servers only: their bytes are not encrypted, so a server with TLS
offers none (its clients' calls stream over gRPC as before).
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from splitfed.channel.transports.bulk.links import ADMITTED, PROTOCOL, TICKET_BYTES, BulkLink
from splitfed.channel.security.bulktls import split_directions
from splitfed.channel.wire.framing import HELLO_LIMITS, FrameError, int_field, recv_head, send_frame, str_field, tune
from splitfed.errors import BulkLinkError, ConfigError, PermissionDeniedError, ResourceExhaustedError

log = logging.getLogger(__name__)

TICKET_TTL_S = 30.0
HANDSHAKE_TIMEOUT_S = 5.0
#: Connections one link may have.
MAX_CONNECTIONS = 16
#: Links one identity may hold at once (each client process opens one per trunk client).
MAX_LINKS_PER_CLIENT = 16
#: Links the server holds at once, all clients together.
MAX_LINKS = 1024
#: Connections in their handshake at once.
MAX_HANDSHAKES = 64


#: Pinned bytes all of a server's links may hold at once (beyond that, received bytes land in pageable memory).
MAX_PINNED_BYTES = 1 << 30


class _HostMemory:
    """Where a server's links read transfers into: pinned memory (the copy engine reads it with no staging copy)
    up to a cap, pageable memory beyond it."""

    def __init__(self, max_pinned: int) -> None:
        self.max_pinned = max_pinned
        self.pinned = 0
        self._lock = threading.Lock()

    def __call__(self, nbytes: int) -> np.ndarray:
        with self._lock:
            if self.pinned + nbytes > self.max_pinned:
                return np.empty(nbytes, dtype=np.uint8)
            self.pinned += nbytes
        owner = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
        weakref.finalize(owner, self._returned, nbytes)
        return owner

    def _returned(self, nbytes: int) -> None:
        with self._lock:
            self.pinned -= nbytes


def host_memory(max_pinned: int = MAX_PINNED_BYTES) -> Callable[[int], np.ndarray] | None:
    """The allocator for a server's links: pinned memory up to ``max_pinned`` bytes when a GPU is there, else
    None (numpy's)."""
    return _HostMemory(max_pinned) if torch.cuda.is_available() else None


@dataclass
class _Offer:
    name: str
    owner: str
    connections: int
    created: float
    socks: list[socket.socket | None] = field(default_factory=list)


class BulkHub:
    """The server's bulk links (see the module docstring).

    Args:
        host: the address to listen on (the gRPC server's).
        port: the port to listen on (0: one of the system's choosing).
        max_connections: connections a link may have (a client asking for more gets this many).
        max_bytes: the largest transfer a link takes (the server's largest tensor).
        max_pending_bytes: bytes one link may hold received but not yet taken.
        alloc: what received transfers are read into (pinned pool memory for a trunk on a GPU).
    """

    def __init__(self, host: str = "127.0.0.1", *, max_connections: int = 4, max_bytes: int = 1 << 30,
                 max_pending_bytes: int = 4 << 30, alloc: Callable[[int], np.ndarray] | None = None,
                 tls: ssl.SSLContext | None = None, port: int = 0) -> None:
        self.host = host
        self.tls = tls
        self._requested_port = int(port)
        self.max_connections = max(1, min(int(max_connections), MAX_CONNECTIONS))
        self.max_bytes = int(max_bytes)
        self.max_pending_bytes = int(max_pending_bytes)
        self.alloc = alloc
        self.port = 0
        self._lock = threading.Lock()
        self._offers: dict[bytes, _Offer] = {}  # by the ticket's digest
        self._links: dict[str, tuple[str, BulkLink]] = {}  # name -> (owner, link)
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)

    def start(self) -> int:
        """Listen (on the port asked for, or one of the system's choosing); returns the port. Raises
        :class:`ConfigError` when the port is taken."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((self.host.strip("[]"), self._requested_port))
        except OSError as exc:
            listener.close()
            raise ConfigError(f"bulk links cannot listen on {self.host}:{self._requested_port} ({exc.strerror}); "
                              "choose another bulk port, or 0 for a free one") from None
        listener.listen(128)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="splitfed-bulk-accept", daemon=True)
        self._thread.start()
        log.info("bulk links offered on port %d (up to %d connections each)", self.port, self.max_connections)
        return self.port

    # -- offers ----------------------------------------------------------------------------------------------
    def offer(self, owner: str, connections: int) -> tuple[str, bytes, int, int]:
        """A new link for ``owner``: ``(name, ticket, port, connections)``. Raises
        :class:`ResourceExhaustedError` past :data:`MAX_LINKS_PER_CLIENT` or :data:`MAX_LINKS`."""
        count = max(1, min(int(connections) or self.max_connections, self.max_connections))
        now = time.monotonic()
        with self._lock:
            self._lapse(now)
            mine = sum(1 for o, _ in self._links.values() if o == owner) + \
                sum(1 for o in self._offers.values() if o.owner == owner)
            if mine >= MAX_LINKS_PER_CLIENT:
                raise ResourceExhaustedError(f"client {owner!r} holds {mine} bulk links, the most one client may; "
                                             "close trunk clients it no longer uses")
            if len(self._links) + len(self._offers) >= MAX_LINKS:
                raise ResourceExhaustedError(f"this server holds {MAX_LINKS} bulk links; try again later")
            ticket = secrets.token_bytes(TICKET_BYTES)
            name = os.urandom(8).hex()
            slots = count * (2 if self.tls is not None else 1)  # TLS: one direction a connection
            self._offers[hashlib.sha256(ticket).digest()] = _Offer(name, owner, count, now, [None] * slots)
        return name, ticket, self.port, count

    def _lapse(self, now: float) -> None:
        """Drop offers older than the ticket's life (holding the lock), closing what attached to them."""
        for digest, offer in list(self._offers.items()):
            if now - offer.created > TICKET_TTL_S:
                del self._offers[digest]
                for sock in offer.socks:
                    if sock is not None:
                        sock.close()

    def link(self, owner: str, name: str) -> BulkLink:
        """The link ``name``, if ``owner`` holds it. Raises :class:`PermissionDeniedError` for another's link,
        :class:`BulkLinkError` (UNAVAILABLE: the client falls back to gRPC) for one not open here."""
        with self._lock:
            held = self._links.get(name)
        if held is None:
            raise BulkLinkError(f"bulk link {name!r} is not open on this server; stream over gRPC or open another")
        if held[0] != owner:
            raise PermissionDeniedError(f"bulk link {name!r} belongs to another client")
        return held[1]

    @property
    def links(self) -> int:
        """Links open now."""
        with self._lock:
            return len(self._links)

    # -- connections -----------------------------------------------------------------------------------------
    def _accept(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._closed:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            if not self._handshakes.acquire(blocking=False):  # a flood of idle connections holds no more threads
                log.warning("bulk connection refused: %d handshakes under way", MAX_HANDSHAKES)
                sock.close()
                continue
            threading.Thread(target=self._handshake, args=(sock,), name="splitfed-bulk-handshake",
                             daemon=True).start()

    def _handshake(self, sock: socket.socket) -> None:
        try:
            self._shake(sock)
        finally:
            self._handshakes.release()

    def _shake(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            if self.tls is not None:  # TLS first: the ticket travels encrypted
                sock = self.tls.wrap_socket(sock, server_side=True)
            got = recv_head(sock, HELLO_LIMITS)
            if got is None:
                raise BulkLinkError("closed before its hello")
            hello = got[0]
            if hello.get("protocol") != PROTOCOL:
                raise BulkLinkError(f"not a bulk connection of this version (protocol "
                                    f"{str(hello.get('protocol'))[:40]!r}, not {PROTOCOL!r})")
            ticket = str_field(hello, "ticket", max_len=2 * TICKET_BYTES)
            try:
                digest = hashlib.sha256(bytes.fromhex(ticket)).digest()
            except ValueError:
                raise FrameError("a bulk hello's ticket is not hexadecimal") from None
            self._attach(digest, int_field(hello, "index", hi=2 * MAX_CONNECTIONS), sock)
        except (OSError, BulkLinkError) as exc:
            log.warning("bulk connection refused: %s", exc)
            sock.close()

    def _attach(self, digest: bytes, index: int, sock: socket.socket) -> None:
        # Blocking before another handshake's thread can start the link's reader on it: a reader that found the
        # socket still in timeout mode (its file non-blocking) mid-switch would read EAGAIN and close the link.
        sock.settimeout(None)
        tune(sock)
        with self._lock:
            self._lapse(time.monotonic())
            offer = self._offers.get(digest)
            if offer is None:
                raise BulkLinkError("unknown or lapsed ticket")
            if index >= len(offer.socks) or offer.socks[index] is not None:
                raise BulkLinkError(f"connection index {index} is not free on link {offer.name}")
            offer.socks[index] = sock
            complete = all(s is not None for s in offer.socks)
            if complete:
                del self._offers[digest]
        if not complete:
            send_frame(sock, ADMITTED)
            return
        socks = [s for s in offer.socks if s is not None]
        ins, outs = split_directions(socks, self.tls is not None, server=True)
        link = BulkLink(offer.name, ins, out_socks=outs, alloc=self.alloc, max_bytes=self.max_bytes,
                        max_pending_bytes=self.max_pending_bytes, on_close=self._closed_link)
        with self._lock:
            if self._closed:
                link.close("the server is stopping")
                return
            self._links[offer.name] = (offer.owner, link)
        link.start()
        # The last answer the client awaits: the link is known by then, its calls may name it.
        send_frame(sock, ADMITTED)
        log.debug("bulk link %s of %s open with %d connections", offer.name, offer.owner, len(socks))

    def _closed_link(self, link: BulkLink, why: str) -> None:
        with self._lock:
            held = self._links.get(link.name)
            if held is not None and held[1] is link:
                del self._links[link.name]
        log.debug("bulk link %s closed: %s", link.name, why)

    def close(self) -> None:
        """Stop listening and close every link (the server stopped)."""
        self._closed = True
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        with self._lock:
            links = [link for _, link in self._links.values()]
            offers = list(self._offers.values())
            self._offers.clear()
        for offer in offers:
            for sock in offer.socks:
                if sock is not None:
                    sock.close()
        for link in links:
            link.close("the server stopped")


__all__ = ["HANDSHAKE_TIMEOUT_S", "MAX_CONNECTIONS", "MAX_PINNED_BYTES", "TICKET_TTL_S", "BulkHub", "host_memory"]
