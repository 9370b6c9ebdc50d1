"""The split channel's method table, request parsing and error-to-status mapping.

Requests are parsed by splitfed's own parsers (zero-copy for tensors); bytes that
do not parse become :class:`Malformed`, which the servicer answers with
INVALID_ARGUMENT (gRPC's generated registration would answer INTERNAL). Every
splitfed error maps to one precise gRPC status (:func:`status_for`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from splitfed.channel.wire import fastwire
from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.wire.limits import SERVICE_NAME
from splitfed.errors import (
    ActivationNotFoundError,
    ActivationStateError,
    AuthError,
    BulkLinkError,
    BulkUnavailableError,
    CodecError,
    ConfigError,
    DuplicateActivationError,
    PermissionDeniedError,
    RegionNotFoundError,
    ResourceExhaustedError,
    SessionNotFoundError,
    SharedMemoryUnavailableError,
    SplitError,
    TrunkBusyError,
    TrunkStepError,
)

_STATUS: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (AuthError, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (ActivationNotFoundError, grpc.StatusCode.NOT_FOUND),
    (SessionNotFoundError, grpc.StatusCode.NOT_FOUND),
    (RegionNotFoundError, grpc.StatusCode.NOT_FOUND),
    (SharedMemoryUnavailableError, grpc.StatusCode.FAILED_PRECONDITION),
    (DuplicateActivationError, grpc.StatusCode.ALREADY_EXISTS),
    (ActivationStateError, grpc.StatusCode.FAILED_PRECONDITION),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TrunkBusyError, grpc.StatusCode.UNAVAILABLE),
    (BulkLinkError, grpc.StatusCode.UNAVAILABLE),
    (BulkUnavailableError, grpc.StatusCode.FAILED_PRECONDITION),
    (TrunkStepError, grpc.StatusCode.INTERNAL),
    (CodecError, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (SplitError, grpc.StatusCode.INVALID_ARGUMENT),
]


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status a splitfed error maps to."""
    for kind, code in _STATUS:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def released(exc: BaseException) -> BaseException:
    """``exc`` and every error chained to it without their tracebacks, once the call is answered with a status.

    A traceback holds each frame the error came through, and what those frames hold (a refused request's
    tensors). A frame that holds the future, task or call context the error was set on closes a reference cycle,
    which would keep all of it until the next garbage collection (rare in a serving process: see
    :func:`splitfed.tuning.serving_thresholds`), one request's bytes for each refused call. Log first: the
    traceback is gone afterwards.
    """
    pending, seen = [exc], set()
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        error.__traceback__ = None
        pending += [error.__cause__, error.__context__]
    return exc


def metadata(context: Any) -> dict[str, str]:
    """Invocation metadata as a dict (last value wins)."""
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


class Malformed:
    """Stands in for a request whose bytes do not parse; the servicer answers INVALID_ARGUMENT."""

    def __init__(self, kind: str, error: Exception) -> None:
        self.kind = kind
        self.error = error


def _safe(parse: Callable[[bytes], Any], kind: str) -> Callable[[bytes], Any]:
    def run(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # CodecError, protobuf's DecodeError, and others on hostile bytes
            return Malformed(kind, exc)
    return run


def check_parsed(message: Any) -> None:
    """Raise :class:`CodecError` (INVALID_ARGUMENT) for a request whose bytes did not parse."""
    if isinstance(message, Malformed):
        raise CodecError(f"request is not a valid {message.kind} message: {message.error}")


def method_handlers(servicer: Any) -> grpc.GenericRpcHandler:
    """The service's handlers for a :class:`~splitfed.channel.server.servicer.SplitChannelServicer`.

    Tensor-carrying messages go through :mod:`splitfed.channel.wire.fastwire`
    (zero-copy); every parser turns unparseable bytes into INVALID_ARGUMENT
    (gRPC's generated registration would answer INTERNAL).
    """
    plain = {"Info": pb.InfoRequest, "Join": pb.JoinRequest, "Leave": pb.LeaveRequest,
             "OpenSession": pb.OpenSessionRequest, "CloseSession": pb.CloseSessionRequest,
             "OpenRegion": pb.OpenRegionRequest, "CloseRegion": pb.CloseRegionRequest,
             "OpenBulk": pb.OpenBulkRequest}
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for name, request in plain.items():
        reply = getattr(pb, request.__name__.replace("Request", "Reply"))
        handlers[name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name), request_deserializer=_safe(request.FromString, request.__name__),
            response_serializer=reply.SerializeToString)
    for name, request in (("Forward", pb.ForwardRequest), ("Backward", pb.BackwardRequest)):
        handlers[name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=_safe(lambda b, m=request: fastwire.parse(m, b), request.__name__),
            response_serializer=lambda p: fastwire.serialize(p.header, p.tensors))
    for name in ("ForwardStream", "BackwardStream"):
        handlers[name] = grpc.stream_stream_rpc_method_handler(
            getattr(servicer, name), request_deserializer=_safe(fastwire.parse_frame, "Frame"),
            response_serializer=fastwire.serialize_frame)
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
