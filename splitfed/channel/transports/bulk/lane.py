"""The client's bulk lane: a :class:`~splitfed.channel.client.trunk.TrunkClient`'s streamed calls with their tensor bytes
over a bulk link (:mod:`splitfed.channel.transports.bulk.links`) instead of gRPC chunks.

The link is opened on the first streamed call (``OpenBulk``, then its connections). If the server offers none,
or the link cannot be opened or breaks, the lane says so once in the log, closes the link, and every call streams
over gRPC from then on; the call that broke is retried like any failed call.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.transports.bulk.links import BulkLink, connect
from splitfed.channel.security.bulktls import split_directions
from splitfed.channel.security.hosts import host_of
from splitfed.channel.wire.replies import pinned_bytes
from splitfed.channel.wire.messages import Assembled, Gather, frames, payload_parts
from splitfed.codec.tensors import EncodedTensor
from splitfed.errors import BulkLinkError, ChannelError, CodecError

log = logging.getLogger(__name__)


class BulkLane:
    """A trunk client's bulk link (see the module docstring).

    Args:
        client: the trunk client (its calls, address and limits).
        connections: TCP connections to ask for (0: no bulk link; the server may grant fewer).
    """

    def __init__(self, client: Any, connections: int = 0) -> None:
        self.client = client
        self.connections = int(connections)
        self.link: BulkLink | None = None
        self._off = self.connections <= 0
        self._lock = threading.Lock()
        self._count = threading.Lock()  # calls end on several threads at once
        #: Streamed calls whose bytes went over the link.
        self.calls = 0
        #: Why the lane gave the link up (None: it did not).
        self.failed: str | None = None

    @property
    def wanted(self) -> bool:
        """Whether streamed calls go over a link (one is open, or will be opened by the next)."""
        return not self._off

    @property
    def active(self) -> bool:
        """Whether a link is open and in use."""
        return self.link is not None and self.link.closed is None

    def ready(self, gpu: bool) -> BulkLink | None:
        """The open link (opened now if there is none yet; received bytes land in pinned memory when ``gpu``), or
        None when calls must stream over gRPC."""
        if self._off:
            return None
        link = self.link
        if link is not None:
            if link.closed is None:
                return link
            self.give_up(f"the link closed ({link.closed})")
            return None
        failed = None
        with self._lock:
            if self.link is None and not self._off:
                try:
                    self.link = self._open(gpu)
                except (ChannelError, BulkLinkError) as exc:
                    failed = exc
        if failed is not None:
            self.give_up(f"it could not be opened: {failed}")
            return None
        return self.link if self.active else None

    def _open(self, gpu: bool) -> BulkLink:
        client = self.client
        reply = client._invoke("OpenBulk", client._stub.OpenBulk, pb.OpenBulkRequest(connections=self.connections))
        tls = client.bulk_tls
        socks = connect(host_of(client.address), reply.port, reply.ticket, reply.connections, tls=tls)
        ins, outs = split_directions(socks, tls is not None, server=False)
        limits = client.limits
        link = BulkLink(reply.link, ins, out_socks=outs, alloc=pinned_bytes if gpu else None,
                        max_bytes=limits.max_tensor_bytes,
                        max_pending_bytes=2 * limits.max_tensor_bytes + limits.max_message_bytes).start()
        log.info("bulk link to %s open: %d connections%s", client.address, link.connections,
                 " each way, TLS" if tls is not None else "")
        return link

    def give_up(self, why: str) -> None:
        """Close the link and stream every call over gRPC from now on (said once in the log)."""
        with self._lock:
            if self._off:
                return
            self._off = True
            self.failed = why
            link = self.link
        log.warning("bulk link to %s not used: %s; streaming over gRPC instead", self.client.address, why)
        if link is not None:
            link.close(why)

    def call(self, link: BulkLink, invoke: Callable[[Iterator[pb.Frame]], Any], header: pb.Frame, field: str,
             encs: Sequence[EncodedTensor], reply_field: str, timeout: float) -> Assembled:
        """One streamed call: the header (with its :class:`BulkRef`) over gRPC, the tensors' bytes over ``link``,
        the reply's likewise. Raises :class:`~splitfed.errors.BulkLinkError` when the link fails (the caller gives
        the lane up and retries), gRPC's errors as they come."""
        transfer = link.next_transfer()
        next(frames(header, field, encs, 1))  # the header's tensors, without their bytes
        header.bulk.CopyFrom(pb.BulkRef(link=link.name, transfer=transfer))
        parts = payload_parts(encs)
        total = sum(len(p) for p in parts)
        try:
            sent = link.send(transfer, parts, total) if total else []
            replies = iter(invoke(iter([header])))
            gather = Gather(next(replies, None), reply_field, self.client.limits.max_tensor_bytes)
            if gather.bulk is None or gather.bulk.transfer != transfer or gather.bulk.link != link.name:
                raise CodecError("the server answered a bulk call without naming its transfer")
            for frame in replies:
                gather.feed(frame)  # raises: a bulk reply carries no chunks
            if gather.total:
                gather.adopt(link.take(transfer, gather.total, timeout))
            for future in sent:
                future.result(timeout)
        finally:
            header.ClearField("bulk")
            link.taken(transfer)
        with self._count:
            self.calls += 1
        return gather.done()

    def close(self) -> None:
        """Close the link (the client closes)."""
        link = self.link
        if link is not None:
            link.close("the client closed")


__all__ = ["BulkLane"]
