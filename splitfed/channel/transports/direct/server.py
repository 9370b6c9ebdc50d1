"""Direct calls: a client on the trunk's host sends its region-carried Forward and Backward straight to the engine.

A client whose tensors cross the cut through a shared-memory region (:mod:`splitfed.channel.transports.shm.lane`) sends, per
call, only a small header: which slices hold its tensor and where the reply goes. Over gRPC that header still takes
the whole way of a call: the client's gRPC stack, a front-end process (:mod:`splitfed.channel.engine.frontend`), the link
to the engine, and back. With many clients on one host those per-call wake-ups and their CPU are what a sync step
waits for (docs/performance.md, "Which part holds the step").

So with each region the engine offers a Unix socket of its own and a ticket (``OpenRegionReply.direct_path`` and
``direct_ticket``). A client that can reach the socket (same host, same user: it lies in a directory only the
server's user may enter) proves itself with the ticket, then sends its Forward and Backward calls there in the
engine link's frames (:mod:`splitfed.channel.engine.link`, :mod:`splitfed.channel.wire.framing`): the same bytes a gRPC call would carry, run by the same
handlers and interceptors. What a connection may do is fixed by its ticket, not by what it sends:

* its calls run with the metadata of the ``OpenRegion`` call that issued the ticket (client id, token, model), so
  a ticket holder acts as the client it was issued to and as no other;
* only ``Forward`` and ``Backward`` (other methods are answered ``PERMISSION_DENIED``);
* a ticket ends when its region is closed; a connection closed with calls in flight cancels them.

The client's end is :mod:`splitfed.channel.transports.direct.client`. Nothing is unpickled: frames are JSON and bytes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from splitfed.channel.engine.calls import EngineDispatch
from splitfed.channel.engine.link import EngineListener
from splitfed.channel.wire.frameconn import FrameConnection
from splitfed.channel.wire.limits import RETRY_KEYS, SERVICE_NAME

log = logging.getLogger(__name__)

#: The methods a direct connection may call.
DIRECT_METHODS = frozenset({f"/{SERVICE_NAME}/Forward", f"/{SERVICE_NAME}/Backward"})
#: Tickets kept at most (one per open region); the oldest go first beyond this.
MAX_TICKETS = 4096


@dataclass(frozen=True)
class Binding:
    """Who a ticket's calls run as: the issuing call's metadata and peer, its client and region."""

    metadata: tuple[tuple[str, str], ...]
    peer: str
    client: str
    region: str


class DirectListener(EngineListener):
    """The engine's socket for direct calls: admits a connection by its ticket and runs its calls as its binding."""

    cancel_on_close = True

    def __init__(self, path: str, calls: DirectCalls, dispatch: EngineDispatch, max_body: int) -> None:
        super().__init__(path, "", dispatch, max_body)
        self.calls = calls
        self.stats = {"calls": 0, "connections": 0, "refused": 0}

    def admit(self, hello: dict[str, Any]) -> Binding | None:
        binding = self.calls.binding(str(hello.get("ticket", "")))
        if binding is None:
            self.stats["refused"] += 1
            log.warning("a connection to the direct-call socket without a valid ticket was closed")
            return None
        self.stats["connections"] += 1
        return binding

    async def welcome(self, conn: FrameConnection) -> None:
        await conn.write({"admitted": True})

    def bind(self, header: dict[str, Any], admitted: Binding) -> dict[str, Any] | None:
        method = header.get("method")
        if self.calls.binding_of(admitted.client, admitted.region) is not admitted:
            return {"code": grpc.StatusCode.UNAUTHENTICATED.name,
                    "details": f"the ticket of region {admitted.region} ended with the region; open a region again"}
        if method not in DIRECT_METHODS:
            return {"code": grpc.StatusCode.PERMISSION_DENIED.name,
                    "details": f"direct calls are Forward and Backward only, not {str(method)[:80]!r}; send it "
                               "over gRPC"}
        timeout = header.get("timeout")
        if timeout is not None and (not isinstance(timeout, (int, float)) or not math.isfinite(timeout)
                                    or timeout <= 0):
            return {"code": grpc.StatusCode.INVALID_ARGUMENT.name,
                    "details": f"a direct call's timeout must be a positive number of seconds, got {timeout!r}"}
        retry = header.get("retry", 0)
        if not isinstance(retry, int) or isinstance(retry, bool) or retry < 0:
            return {"code": grpc.StatusCode.INVALID_ARGUMENT.name,
                    "details": f"a direct call's retry must be the number of attempts before it, got {retry!r}"}
        # A retry is answered from what its first attempt left (a saved forward, a remembered backward), as over gRPC.
        header["md"] = admitted.metadata + ((RETRY_KEYS[1], str(retry)),) if retry else admitted.metadata
        header["peer"] = admitted.peer
        return None


class DirectCalls:
    """The server's direct-call socket and its tickets (one per open region).

    Args:
        max_body: the largest frame body a connection may send (the server's largest message).
    """

    def __init__(self, max_body: int) -> None:
        self.max_body = max_body
        self.path = ""
        self.listener: DirectListener | None = None
        self._dir: str | None = None
        self._tickets: OrderedDict[str, Binding] = OrderedDict()
        self._by_region: dict[tuple[str, str], str] = {}

    async def start(self, handlers: Sequence[grpc.GenericRpcHandler], interceptors: Sequence[Any]) -> None:
        """Listen on a socket in a new directory only this user may enter (on the running loop)."""
        self._dir = tempfile.mkdtemp(prefix="splitfed-direct-")
        path = os.path.join(self._dir, "calls.sock")
        self.listener = DirectListener(path, self, EngineDispatch(list(handlers), list(interceptors)), self.max_body)
        await self.listener.start()
        self.path = path
        log.debug("direct calls offered on %s", path)

    async def stop(self) -> None:
        """Stop listening, cancel the calls in flight, forget every ticket and remove the socket."""
        self.path = ""
        self._tickets.clear()
        self._by_region.clear()
        if self.listener is not None:
            await self.listener.stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def issue(self, metadata: Sequence[Any], peer: str, client: str, region: str) -> tuple[str, str]:
        """The socket's path and a new ticket whose calls run with ``metadata`` and ``peer`` as ``client``, for as
        long as ``region`` is open; ``("", "")`` when none is offered."""
        if not self.path:
            return "", ""
        md = tuple((str(k), str(v)) for k, v in metadata if isinstance(v, str) and k not in RETRY_KEYS)
        self.revoke(client, region)
        ticket = secrets.token_urlsafe(32)
        binding = Binding(md, peer, client, region)
        self._tickets[ticket] = binding
        self._by_region[(client, region)] = ticket
        while len(self._tickets) > MAX_TICKETS:
            _, old = self._tickets.popitem(last=False)
            self._by_region.pop((old.client, old.region), None)
        return self.path, ticket

    def revoke(self, client: str, region: str) -> None:
        """End the ticket of ``client``'s ``region`` (closed)."""
        ticket = self._by_region.pop((client, region), None)
        if ticket is not None:
            self._tickets.pop(ticket, None)

    def binding(self, ticket: str) -> Binding | None:
        """What ``ticket`` admits (None: no such ticket)."""
        return self._tickets.get(ticket) if ticket else None

    def binding_of(self, client: str, region: str) -> Binding | None:
        """The binding of ``client``'s ``region``'s ticket while it lasts."""
        ticket = self._by_region.get((client, region))
        return None if ticket is None else self._tickets.get(ticket)


async def start_direct(calls: DirectCalls | None, handlers: Sequence[grpc.GenericRpcHandler],
                       interceptors: Sequence[Any]) -> None:
    """Start ``calls`` (when the server offers them); a socket that cannot be made is logged and not offered."""
    if calls is None:
        return
    try:
        await calls.start(handlers, interceptors)
    except OSError as exc:
        log.warning("direct calls are not offered (%s); calls go over gRPC", exc)
        asyncio.ensure_future(calls.stop())
