"""The trunk server: the split channel's gRPC service around a :class:`TrunkRuntime`.

Thin servicer methods decode requests, call the runtime and encode replies;
every failure leaves as a precise gRPC status (never UNKNOWN), the server keeps
serving, and nothing the runtime holds changes on a rejected request. The
server also exposes gRPC's standard health service and server reflection.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from torch import nn

from splitfed.channel import fastwire
from splitfed.channel import split_channel_pb2 as pb
from splitfed.channel import split_channel_pb2_grpc as pb_grpc
from splitfed.channel.metrics import TrunkMetrics
from splitfed.channel.wire import assemble, decode_single, decode_state, encode, frames, payload_bytes
from splitfed.codec import TensorLimits, WireDType
from splitfed.tuning import tune_malloc
from splitfed.errors import (
    ActivationNotFoundError,
    ActivationStateError,
    AuthError,
    CodecError,
    ConfigError,
    DuplicateActivationError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SessionNotFoundError,
    SplitFedError,
)
from splitfed.optim import make_optimizer
from splitfed.trunk.aggregation import Outcome, TrunkAggregator
from splitfed.trunk.runtime import GradientGuard, TrunkRuntime
from splitfed.trunk.sessions import SessionLimits, SessionManager, supports_sessions
from splitfed.trunk.store import StoreLimits

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SplitChannel"].full_name
CLIENT_ID_KEY = "x-splitfed-client"
RETRY_KEYS = ("grpc-previous-rpc-attempts", "x-splitfed-retry")

_STATUS: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (AuthError, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (ActivationNotFoundError, grpc.StatusCode.NOT_FOUND),
    (SessionNotFoundError, grpc.StatusCode.NOT_FOUND),
    (DuplicateActivationError, grpc.StatusCode.ALREADY_EXISTS),
    (ActivationStateError, grpc.StatusCode.FAILED_PRECONDITION),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (CodecError, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
]

_OUTCOME = {
    Outcome.APPLIED: pb.APPLIED,
    Outcome.DOWNWEIGHTED: pb.DOWNWEIGHTED,
    Outcome.REJECTED_STALE: pb.REJECTED_STALE,
    Outcome.REJECTED_GUARD: pb.REJECTED_GUARD,
    Outcome.NOT_TRAINED: pb.NOT_TRAINED,
}

T = TypeVar("T")


@dataclass(frozen=True)
class ChannelLimits:
    """Sizes on the wire.

    Args:
        max_message_bytes: largest single gRPC message either side accepts.
        stream_threshold_bytes: tensor payloads above this travel over the
            streaming RPCs, in chunks of ``chunk_bytes``.
        max_tensor_bytes: largest total payload of one streamed request.
    """

    max_message_bytes: int = 8 << 20
    stream_threshold_bytes: int = 4 << 20
    chunk_bytes: int = 1 << 20
    max_tensor_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if not 0 < self.chunk_bytes <= self.max_message_bytes - 1024:
            raise ConfigError("chunk_bytes must be positive and leave room for framing below max_message_bytes")
        if self.stream_threshold_bytes > self.max_message_bytes - 64 * 1024:
            raise ConfigError("stream_threshold_bytes must stay 64 KiB below max_message_bytes")

    def grpc_options(self) -> list[tuple[str, int]]:
        """Channel/server options that enforce these sizes."""
        return [("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", self.max_message_bytes)]


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status a splitfed error maps to."""
    for kind, code in _STATUS:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def metadata(context: grpc.ServicerContext) -> dict[str, str]:
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


def method_handlers(servicer: SplitChannelServicer) -> grpc.GenericRpcHandler:
    """The service's handlers.

    Tensor-carrying messages go through :mod:`splitfed.channel.fastwire`
    (zero-copy); every parser turns unparseable bytes into INVALID_ARGUMENT
    (gRPC's generated registration would answer INTERNAL).
    """
    plain = {"Info": pb.InfoRequest, "Join": pb.JoinRequest, "Leave": pb.LeaveRequest,
             "OpenSession": pb.OpenSessionRequest, "CloseSession": pb.CloseSessionRequest}
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


def _check_parsed(message: Any) -> None:
    if isinstance(message, Malformed):
        raise CodecError(f"request is not a valid {message.kind} message: {message.error}")


class SplitChannelServicer(pb_grpc.SplitChannelServicer):
    """Decodes, calls the runtime, encodes; every error becomes a precise status."""

    def __init__(self, runtime: TrunkRuntime, limits: ChannelLimits, *, model_name: str = "",
                 cuts: tuple[int, int] | None = None,
                 authenticate: Callable[[dict[str, str]], str] | None = None, sessions: Any = None) -> None:
        self.runtime = runtime
        self.limits = limits
        self.tensor_limits = TensorLimits(max_bytes=limits.max_tensor_bytes)
        self.model_name = model_name
        self.cuts = cuts
        self.authenticate = authenticate
        self.sessions = sessions
        self.metrics: Any = None  # TrunkMetrics when the server exports metrics

    # -- helpers ---------------------------------------------------------------
    def _identity(self, context: grpc.ServicerContext) -> tuple[str, bool]:
        md = metadata(context)
        retry = any(md.get(k, "0") not in ("", "0") for k in RETRY_KEYS)
        if self.authenticate is not None:
            return self.authenticate(md), retry
        client = md.get(CLIENT_ID_KEY) or context.peer()
        return client, retry

    def _call(self, context: grpc.ServicerContext, fn: Callable[[], T], request: Any = None) -> T:
        try:
            _check_parsed(request)
            return fn()
        except SplitFedError as exc:
            code = status_for(exc)
            log.warning("%s: %s", code.name, exc)
            context.abort(code, str(exc))
        except (RuntimeError, ValueError, IndexError) as exc:
            # Raised by the trunk for inputs that passed the codec but do not fit the model.
            log.warning("INVALID_ARGUMENT: the trunk could not process the input: %s", exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the trunk could not process the input: {exc}")
        except Exception as exc:  # a bug: say so, keep serving
            log.exception("internal error while serving a request")
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in the trunk server: {exc!r}")
        raise AssertionError("unreachable")  # pragma: no cover

    # -- RPCs --------------------------------------------------------------------
    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoReply:
        from splitfed import __version__

        self._call(context, lambda: None, request)
        return pb.InfoReply(model=self.model_name, cuts=list(self.cuts or ()),
                            trunk_mode=self.runtime.aggregator.mode, trunk_version=self.runtime.version,
                            max_message_bytes=self.limits.max_message_bytes,
                            stream_threshold_bytes=self.limits.stream_threshold_bytes,
                            auth_required=self.authenticate is not None, server_version=__version__)

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        def run() -> pb.JoinReply:
            client, _ = self._identity(context)
            size = self.runtime.join(client)
            return pb.JoinReply(trunk_version=self.runtime.version, group_size=size)
        return self._call(context, run, request)

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveReply:
        def run() -> pb.LeaveReply:
            client, _ = self._identity(context)
            return pb.LeaveReply(group_size=self.runtime.leave(client))
        return self._call(context, run, request)

    def _forward(self, context: grpc.ServicerContext, req: pb.ForwardRequest, tensors: list, unary: bool
                 ) -> tuple[pb.ForwardReply, list]:
        client, retry = self._identity(context)
        if not req.activation_id:
            raise CodecError("activation_id is empty; send a unique id per forward")
        state = decode_state(tensors, self.tensor_limits)
        if self.metrics is not None:
            self.metrics.tensors("received", tensors)
        if req.session_id:
            if self.sessions is None:
                raise SessionNotFoundError("this server does not serve inference sessions")
            out, version = self.sessions.step(client, req.session_id, state), self.runtime.version
        else:
            out, version = self.runtime.forward(client, req.activation_id, state, train=req.train,
                                                num_examples=req.num_examples, retry=retry)
        reply_dtype = WireDType(req.reply_dtype) if req.reply_dtype else None
        encs = [encode("hidden", out, reply_dtype)]
        if self.metrics is not None:
            self.metrics.tensors("sent", encs)
        if unary and payload_bytes(encs) > self.limits.stream_threshold_bytes:
            if req.train and not req.session_id:
                self.runtime.forget(client, req.activation_id)
            raise ResourceExhaustedError(
                f"reply of {payload_bytes(encs)} bytes is above the unary threshold; use ForwardStream")
        return pb.ForwardReply(activation_id=req.activation_id, trunk_version=version), encs

    def _backward(self, context: grpc.ServicerContext, req: pb.BackwardRequest, tensors: list
                  ) -> tuple[pb.BackwardReply, list]:
        client, retry = self._identity(context)
        grad = decode_single(tensors, "grad", self.tensor_limits)
        if self.metrics is not None:
            self.metrics.tensors("received", tensors)
        res = self.runtime.backward(client, req.activation_id, grad, retry=retry)
        reply_dtype = WireDType(req.reply_dtype) if req.reply_dtype else None
        encs = [encode("grad", res.grad_in, reply_dtype)]
        if self.metrics is not None:
            self.metrics.tensors("sent", encs)
        reply = pb.BackwardReply(activation_id=req.activation_id, trunk_version=res.result.version,
                                 outcome=_OUTCOME[res.result.outcome], staleness=res.result.staleness)
        return reply, encs

    def Forward(self, request: fastwire.Parsed, context: grpc.ServicerContext) -> fastwire.Parsed:
        def run() -> fastwire.Parsed:
            return fastwire.Parsed(*self._forward(context, request.header, request.tensors, unary=True))
        return self._call(context, run, request)

    def Backward(self, request: fastwire.Parsed, context: grpc.ServicerContext) -> fastwire.Parsed:
        def run() -> fastwire.Parsed:
            return fastwire.Parsed(*self._backward(context, request.header, request.tensors))
        return self._call(context, run, request)

    def _stream(self, request_iterator: Iterable[pb.Frame], context: grpc.ServicerContext, field: str,
                reply_field: str, handler: Callable[..., tuple[Any, list]]) -> Iterator[pb.Frame]:
        def checked() -> Iterator[pb.Frame]:
            for frame in request_iterator:
                _check_parsed(frame)
                yield frame

        def run() -> list[pb.Frame]:
            msg = assemble(checked(), field, self.limits.max_tensor_bytes)
            reply, encs = handler(context, msg.header, msg.tensors)
            header = pb.Frame(**{reply_field: reply})
            return list(frames(header, reply_field, encs, self.limits.chunk_bytes))
        yield from self._call(context, run)

    def ForwardStream(self, request_iterator: Iterable[pb.Frame], context: grpc.ServicerContext
                      ) -> Iterator[pb.Frame]:
        return self._stream(request_iterator, context, "forward_request", "forward_reply",
                            lambda ctx, h, t: self._forward(ctx, h, t, unary=False))

    def BackwardStream(self, request_iterator: Iterable[pb.Frame], context: grpc.ServicerContext
                       ) -> Iterator[pb.Frame]:
        return self._stream(request_iterator, context, "backward_request", "backward_reply", self._backward)

    def OpenSession(self, request: pb.OpenSessionRequest, context: grpc.ServicerContext) -> pb.OpenSessionReply:
        def run() -> pb.OpenSessionReply:
            client, _ = self._identity(context)
            if self.sessions is None:
                raise SessionNotFoundError("this server does not serve inference sessions")
            session_id, ttl = self.sessions.open(client, max_length=request.max_length,
                                                 batch_size=max(request.batch_size, 1))
            return pb.OpenSessionReply(session_id=session_id, idle_ttl_s=ttl)
        return self._call(context, run, request)

    def CloseSession(self, request: pb.CloseSessionRequest, context: grpc.ServicerContext
                     ) -> pb.CloseSessionReply:
        def run() -> pb.CloseSessionReply:
            client, _ = self._identity(context)
            if self.sessions is None:
                raise SessionNotFoundError("this server does not serve inference sessions")
            self.sessions.close(client, request.session_id)
            return pb.CloseSessionReply()
        return self._call(context, run, request)


class TrunkServer:
    """Serves a trunk over the split channel.

    Quickstart::

        server = TrunkServer(parts.trunk, lr=0.01, port=50051, insecure=True).start()
        server.wait()

    Args:
        trunk: the trunk module, or a ready :class:`TrunkRuntime`.
        host, port: where to listen (port 0 picks a free one; see :attr:`port`).
        insecure: serve plaintext; required unless ``credentials`` are given.
        credentials: ``grpc.ServerCredentials`` for TLS.
        optimizer, lr, momentum, weight_decay: the trunk's optimizer when ``trunk`` is a module.
        aggregator: sync (default), async or quorum; see :mod:`splitfed.trunk.aggregation`.
        limits: message sizes; store_limits: saved-forward TTL and budget.
        max_workers: threads serving RPCs (sync mode parks one per waiting client).
        sessions: serves inference sessions (default: a :class:`SessionManager` with
            ``session_limits`` for trunks that can hold a KV cache).
    """

    def __init__(self, trunk: nn.Module | TrunkRuntime, *, host: str = "127.0.0.1", port: int = 0,
                 insecure: bool = False, credentials: grpc.ServerCredentials | None = None,
                 optimizer: str = "sgd", lr: float = 0.01, momentum: float = 0.0, weight_decay: float = 0.0,
                 aggregator: TrunkAggregator | None = None, limits: ChannelLimits = ChannelLimits(),
                 store_limits: StoreLimits = StoreLimits(), guard: GradientGuard = GradientGuard(),
                 max_workers: int = 64, model_name: str = "", cuts: tuple[int, int] | None = None,
                 authenticate: Callable[[dict[str, str]], str] | None = None, sessions: Any = None,
                 interceptors: list[grpc.ServerInterceptor] | None = None,
                 session_limits: SessionLimits = SessionLimits(), metrics_port: int | None = None,
                 metrics_host: str = "127.0.0.1") -> None:
        tune_malloc()
        if credentials is None and not insecure:
            raise ConfigError("the trunk server needs TLS credentials, or insecure=True to serve plaintext "
                              "(for loopback and tests)")
        if isinstance(trunk, TrunkRuntime):
            self.runtime = trunk
        else:
            trainable = [p for p in trunk.parameters() if p.requires_grad]
            opt = make_optimizer(optimizer, trainable, lr, momentum=momentum,
                                 weight_decay=weight_decay) if trainable else None
            self.runtime = TrunkRuntime(trunk, opt, aggregator=aggregator, limits=store_limits, guard=guard)
        if sessions is None and supports_sessions(self.runtime.trunk):
            sessions = SessionManager.from_limits(self.runtime, session_limits)
        self.limits = limits
        self.host = host
        self._requested_port = port
        self._credentials = credentials
        self.servicer = SplitChannelServicer(self.runtime, limits, model_name=model_name, cuts=cuts,
                                             authenticate=authenticate, sessions=sessions)
        interceptors = list(interceptors or [])
        self.metrics: TrunkMetrics | None = None
        self._metrics_port, self._metrics_host, self.metrics_port = metrics_port, metrics_host, 0
        if metrics_port is not None:
            self.metrics = TrunkMetrics()
            self.metrics.watch(self.runtime, sessions)
            self.runtime.aggregator.observer = self.metrics.observe_aggregator
            self.servicer.metrics = self.metrics
            interceptors.insert(0, self.metrics.interceptor())
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                              thread_name_prefix="splitfed-trunk"),
                                   options=limits.grpc_options(), interceptors=interceptors,
                                   maximum_concurrent_rpcs=max_workers * 4)
        self._server.add_generic_rpc_handlers((method_handlers(self.servicer),))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                            self._server)
        self.port = 0
        self._janitor: threading.Thread | None = None
        self._stopping = threading.Event()

    @property
    def address(self) -> str:
        """``host:port`` the server listens on (after :meth:`start`)."""
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"

    def start(self) -> TrunkServer:
        """Bind, start serving and mark the service SERVING; returns self."""
        target = f"{self.host}:{self._requested_port}" if ":" not in self.host else \
            f"[{self.host.strip('[]')}]:{self._requested_port}"
        if self._credentials is not None:
            self.port = self._server.add_secure_port(target, self._credentials)
        else:
            self.port = self._server.add_insecure_port(target)
        if not self.port:
            raise ConfigError(f"could not bind the trunk server to {target}; is the port in use?")
        self._server.start()
        if self.metrics is not None:
            self.metrics_port = self.metrics.serve(self._metrics_port or 0, self._metrics_host)
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._janitor = threading.Thread(target=self._sweep_loop, name="splitfed-janitor", daemon=True)
        self._janitor.start()
        log.info("trunk server listening on %s (%s, %s)", self.address,
                 "TLS" if self._credentials is not None else "plaintext", self.runtime.aggregator.describe())
        return self

    def _sweep_loop(self) -> None:
        period = max(min(self.runtime.store.limits.ttl_s / 4, 10.0), 0.05)
        while not self._stopping.wait(period):
            self.runtime.sweep()
            if self.servicer.sessions is not None:
                self.servicer.sessions.sweep()

    def stop(self, grace: float | None = 1.0) -> None:
        """Mark NOT_SERVING and stop; in-flight RPCs get ``grace`` seconds."""
        self._stopping.set()
        self.health.enter_graceful_shutdown()
        self._server.stop(grace).wait()
        if self.metrics is not None:
            self.metrics.stop()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stops (or ``timeout``)."""
        return self._server.wait_for_termination(timeout)

    def __enter__(self) -> TrunkServer:
        return self.start() if not self.port else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
