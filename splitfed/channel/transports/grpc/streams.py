"""A trunk client's streamed calls: above the unary threshold, a request and its reply travel as a stream of
frames (gRPC chunks, or a header whose bytes go over a bulk link, :mod:`splitfed.channel.transports.bulk.lane`), retried by
the client itself since gRPC's own retries cannot replay a long request stream."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.transports.bulk.links import BULK_MIN_BYTES
from splitfed.channel.wire.replies import channel_error
from splitfed.channel.wire.messages import assemble, frames
from splitfed.codec.tensors import EncodedTensor
from splitfed.errors import BulkLinkError, ChannelError

log = logging.getLogger(__name__)


def stream_threshold(client: Any) -> int:
    """Bytes above which ``client``'s calls stream: its limits' threshold, or
    :data:`~splitfed.channel.transports.bulk.links.BULK_MIN_BYTES` when lower and a bulk link carries streamed calls' bytes (a
    large unary message costs more than a bulk transfer)."""
    threshold = client.limits.stream_threshold_bytes
    return min(threshold, BULK_MIN_BYTES) if client.bulk.wanted else threshold


#: Statuses a server answers about a call's request itself (its tensors, ids, identity), not about the way it came.
REQUEST_REFUSALS = frozenset({"INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "FAILED_PRECONDITION",
                              "RESOURCE_EXHAUSTED", "UNAUTHENTICATED", "PERMISSION_DENIED", "OUT_OF_RANGE"})


def link_failed(error: ChannelError, closed: bool) -> bool:
    """Whether a streamed call that failed with ``error`` over a bulk link (``closed``: the link is closed now) shows
    the link failing: it broke or closed, the call found no link on the server (UNAVAILABLE) or another client's
    (PERMISSION_DENIED naming the link), its bytes did not come in time; not when the server refused the request."""
    return closed or error.code not in REQUEST_REFUSALS or "bulk link" in str(error)


def stream_call(client: Any, name: str, fn: Callable[..., Iterator[pb.Frame]], header: pb.Frame, field: str,
                encs: list[EncodedTensor], reply_field: str, extra: Sequence[tuple[str, str]] = (),
                alloc: Callable[[int], Any] | None = None) -> Any:
    """A streamed call of ``client`` (a :class:`~splitfed.channel.client.trunk.TrunkClient`), retried like unary ones.

    Retries carry ``x-splitfed-retry`` so that the server answers them from
    what the first attempt left (a saved forward, a remembered backward):
    a retried gradient is never applied twice. The reply's bytes gather in what ``alloc`` gives (pinned
    memory for a caller on a GPU), else in numpy's memory. An attempt whose bulk link fails gives the link up;
    the retry streams over gRPC. A request the server refused over a working link (a malformed tensor, an unknown
    id) keeps the link: the next calls still take it.
    """
    policy, bulk = client.retry, client.bulk
    attempt, delay = 0, policy.initial_backoff_s
    deadline = time.monotonic() + policy.timeout_s
    while True:
        metadata = list(extra) + ([("x-splitfed-retry", str(attempt))] if attempt else [])
        link = bulk.ready(alloc is not None)
        try:
            if link is not None:
                return bulk.call(link, lambda it: client._invoke(name, fn, it, metadata), header, field, encs,
                                 reply_field, max(deadline - time.monotonic(), 0.0))
            replies = client._invoke(name, fn, frames(header, field, encs, client.limits.chunk_bytes), metadata)
            return assemble(replies, reply_field, client.limits.max_tensor_bytes, alloc)
        except grpc.RpcError as exc:
            error = channel_error(name, client.address, exc.code(), exc.details())
            exc.__traceback__ = None  # the call is the error: through its traceback, this frame's would hold it
        except ChannelError as exc:
            error = exc
        except BulkLinkError as exc:
            error = ChannelError(f"{name} to trunk server {client.address} lost its bulk link: {exc}", "UNAVAILABLE")
        if link is not None and link_failed(error, link.closed is not None):
            bulk.give_up(f"{name} failed over it ({error})")
        attempt += 1
        if (error.code not in policy.retryable_codes or attempt >= max(policy.max_attempts, 1)
                or time.monotonic() + delay > deadline):
            try:
                raise error from None
            finally:
                del error  # its traceback holds this frame, which would hold it: a cycle keeping the request
        log.warning("%s failed with %s; retrying in %.2fs (attempt %d of %d)", name, error.code, delay,
                    attempt + 1, policy.max_attempts)
        time.sleep(delay)
        delay = min(delay * policy.backoff_multiplier, policy.max_backoff_s)


__all__ = ["REQUEST_REFUSALS", "link_failed", "stream_call", "stream_threshold"]
