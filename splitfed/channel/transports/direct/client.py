"""The client's end of direct calls (:mod:`splitfed.channel.transports.direct.server`): Forward and Backward frames over the engine's
Unix socket, with blocking sockets (the calling thread sleeps in the kernel until its reply, without the GIL).

One connection carries one call at a time; a client's threads (micro-batches, :meth:`TrunkClient.submit`) each take
a connection of their own from a small pool. A connection the engine refuses (a ticket that ended, another user's
socket) raises :class:`DirectRefused` before anything is sent, so the call can go over gRPC instead. A call the engine
answers with a retryable status (UNAVAILABLE: its model is loading, reloading or being unloaded) is retried under
the client's :class:`~splitfed.channel.wire.retry.RetryPolicy` and retry budget, as gRPC retries the same call.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
from typing import Any

import grpc

from splitfed.channel.wire import fastwire
from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.wire.framing import HELLO_LIMITS, FrameLimits, int_field, recv_frame, send_frame, tune
from splitfed.channel.wire.limits import SERVICE_NAME
from splitfed.channel.wire.replies import channel_error
from splitfed.channel.wire.retry import RetryBudget, RetryPolicy, retrying
from splitfed.errors import ChannelError

log = logging.getLogger(__name__)

_REPLIES = {"Forward": pb.ForwardReply, "Backward": pb.BackwardReply}
#: Seconds a connection waits for the engine to admit it.
ADMIT_TIMEOUT_S = 10.0
#: Seconds past a call's deadline that this end waits for the engine's own DEADLINE_EXCEEDED.
_GRACE_S = 5.0


class DirectRefused(ConnectionError):
    """The engine's direct-call socket cannot be used (unreachable, or it refused the ticket); nothing was sent."""


class DirectLink:
    """A client's direct calls to the engine at ``path``, admitted by ``ticket``.

    Args:
        path: the engine's socket (``OpenRegionReply.direct_path``).
        ticket: the ticket that admits this client (``OpenRegionReply.direct_ticket``).
        address: the trunk server's address (for error messages).
        max_body: the largest reply body accepted.
        retry: the retry policy of the client's gRPC calls, applied to these calls too (None: no retries).
        budget: the retry budget these calls spend (default: one of ``retry``'s own).
    """

    def __init__(self, path: str, ticket: str, address: str, max_body: int, retry: RetryPolicy | None = None,
                 budget: RetryBudget | None = None) -> None:
        self.path = path
        self.ticket = ticket
        self.address = address
        self.max_body = max_body
        self._limits = FrameLimits(max_body)
        self.retry = retry
        self.budget = budget if budget is not None or retry is None else RetryBudget.of(retry)
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._ids = 0
        self.closed = False
        #: Calls that went this way.
        self.calls = 0

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(ADMIT_TIMEOUT_S)
            sock.connect(self.path)
            tune(sock)
            send_frame(sock, {"ticket": self.ticket})
            welcome, _ = recv_frame(sock, HELLO_LIMITS)
            if welcome.get("admitted") is not True:
                raise ConnectionError(f"unexpected welcome {welcome!r}")
        except (OSError, ValueError) as exc:
            sock.close()
            raise DirectRefused(f"the engine's direct-call socket {self.path} cannot be used: {exc}") from None
        return sock

    def _take(self) -> socket.socket:
        with self._lock:
            if self.closed:
                raise DirectRefused("the direct link is closed")
            if self._idle:
                return self._idle.pop()
        return self._connect()

    def _give(self, sock: socket.socket) -> None:
        with self._lock:
            if not self.closed:
                self._idle.append(sock)
                return
        sock.close()

    def call(self, name: str, request: fastwire.Parsed, timeout: float | None) -> fastwire.Parsed:
        """One ``Forward`` or ``Backward``: its parsed reply, retried under the link's retry policy within
        ``timeout`` seconds in all. Raises :class:`DirectRefused` when the socket cannot be used (nothing sent
        by that attempt), :class:`~splitfed.errors.ChannelError` with the call's last status otherwise."""
        if self.retry is None:
            return self._attempt(name, request, timeout)
        assert self.budget is not None
        attempts = itertools.count()
        return retrying(lambda left: self._attempt(name, request, left, next(attempts)), self.retry, self.budget,
                        f"{name} to trunk server {self.address} over the direct-call socket", timeout)

    def _attempt(self, name: str, request: fastwire.Parsed, timeout: float | None, retry: int = 0
                 ) -> fastwire.Parsed:
        """One attempt of :meth:`call`; ``retry``: how many came before it (the engine answers a retry from what the
        first attempt left, as it answers gRPC's retries, so a call whose reply was lost is never applied twice)."""
        sock = self._take()
        with self._lock:
            self._ids += 1
            call_id = self._ids
        try:
            sock.settimeout(None if timeout is None else timeout + _GRACE_S)
            header = {"id": call_id, "method": f"/{SERVICE_NAME}/{name}", "timeout": timeout}
            if retry:
                header["retry"] = retry
            send_frame(sock, header, [fastwire.serialize(request.header, request.tensors)])
            reply, body = recv_frame(sock, self._limits)
            if int_field(reply, "id") != call_id:
                raise ConnectionError(f"a direct-call reply for call {reply.get('id')!r} came to call {call_id}")
        except socket.timeout:
            sock.close()  # the engine cancels a closed connection's calls
            raise channel_error(name, self.address, grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no reply over the direct-call socket within {timeout} s") from None
        except (OSError, ValueError) as exc:
            sock.close()
            raise channel_error(name, self.address, grpc.StatusCode.UNAVAILABLE,
                                f"the direct-call connection broke: {exc}") from None
        self._give(sock)
        code = str(reply.get("code", ""))
        if code != "OK":
            status = getattr(grpc.StatusCode, code, grpc.StatusCode.UNKNOWN)
            raise channel_error(name, self.address, status, str(reply.get("details", "")))
        try:
            parsed = fastwire.parse(_REPLIES[name], body)
        except Exception as exc:  # noqa: BLE001 - a reply that does not parse is the server's fault
            raise ChannelError(f"{name} to trunk server {self.address}: its direct-call reply did not parse ({exc})",
                               code="INTERNAL") from None
        with self._lock:
            self.calls += 1
        return parsed

    def close(self) -> None:
        """Close every connection (the engine cancels calls still in flight on them)."""
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()
