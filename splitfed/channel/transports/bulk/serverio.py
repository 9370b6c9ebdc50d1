"""The servicer's side of bulk links: the ``OpenBulk`` call, a streamed request's bytes taken from its link, and
its reply's bytes sent back over it (see :mod:`splitfed.channel.transports.bulk.links`).

A mixin of :class:`~splitfed.channel.server.servicer.SplitChannelServicer`; :attr:`BulkService.bulk` is the server's
:class:`~splitfed.channel.transports.bulk.hub.BulkHub` (None: the server offers no links).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.transports.bulk.hub import BulkHub
from splitfed.channel.wire.messages import Gather, frames, payload_parts
from splitfed.codec.tensors import EncodedTensor
from splitfed.errors import BulkLinkError, BulkUnavailableError

#: How long a request's bulk bytes may take after its header came, when the call has no deadline.
TAKE_TIMEOUT_S = 60.0


def _remaining(context: Any) -> float:
    left = context.time_remaining() if context is not None else None
    return TAKE_TIMEOUT_S if left is None else max(min(left, TAKE_TIMEOUT_S), 0.0)


class BulkService:
    """``OpenBulk`` and a streamed call's bytes over a bulk link (see the module docstring)."""

    bulk: BulkHub | None = None
    _call: Any
    _identity: Any

    def _hub(self) -> BulkHub:
        if self.bulk is None:
            raise BulkUnavailableError("this trunk server offers no bulk links (a plaintext server offers them when "
                                       "started with bulk_connections > 0, --bulk-connections N); stream over gRPC")
        return self.bulk

    async def OpenBulk(self, request: pb.OpenBulkRequest, context: Any) -> pb.OpenBulkReply:
        async def run() -> pb.OpenBulkReply:
            client, _ = self._identity(context)
            name, ticket, port, count = self._hub().offer(client, request.connections)
            return pb.OpenBulkReply(link=name, ticket=ticket, port=port, connections=count)
        return await self._call(context, run, request)

    async def _bulk_take(self, client: str, gather: Gather, context: Any) -> None:
        """Wait for the bytes of ``gather``'s bulk transfer (no thread held) and hand them to it."""
        ref = gather.bulk
        link = self._hub().link(client, ref.link)
        timeout = _remaining(context)
        try:
            future = link.pending(ref.transfer, gather.total)
            buf = await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except TimeoutError:
            raise BulkLinkError(f"the bytes of transfer {ref.transfer} did not come over bulk link {ref.link} "
                                f"within {timeout:.1f}s of its header") from None
        finally:
            link.taken(ref.transfer)
        gather.adopt(buf)

    async def _bulk_reply(self, client: str, ref: pb.BulkRef, header: pb.Frame, field: str,
                          encs: Sequence[EncodedTensor]) -> list[pb.Frame]:
        """The reply as one header frame naming ``ref``, its tensors' bytes sent over the link first."""
        link = self._hub().link(client, ref.link)
        next(frames(header, field, encs, 1))  # the header's tensors, without their bytes
        parts = payload_parts(encs)
        total = sum(len(p) for p in parts)
        if total:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in link.send(ref.transfer, parts, total)))
        header.bulk.CopyFrom(ref)
        return [header]


__all__ = ["TAKE_TIMEOUT_S", "BulkService"]
