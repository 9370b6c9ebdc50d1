"""The split channel's router: one address in front of several trunk servers, forwarding calls as raw bytes.

:class:`Router` is a ``grpc.aio`` server (on an event loop of its own thread, as
:class:`~splitfed.channel.server.trunkserver.TrunkServer` is) whose generic handlers take
every method of the split channel, unary and streamed, as bytes and hand them
to one backend's channel unchanged: no tensor is decoded, no message parsed.
The backend of a call comes from :class:`~splitfed.channel.routing.table.RouteTable`
(sticky per client and model, new clients by load, only backends that hold the
model named by ``x-splitfed-model``).

What passes through: the call's metadata (client id, token, the model, a
retried call's attempt count as ``x-splitfed-retry``, so that the backend answers
a retry from what the first attempt left), its deadline (what is left of it),
its cancellation (a client that cancels cancels the backend's call), and the
backend's status, message and trailing metadata. A backend that cannot be
reached makes the call fail with UNAVAILABLE (clients retry) and is probed at
once; once down, its clients' pins end and their next calls, and every new
client's, go to the backends that live. The router answers by itself only when
no backend can take a call: UNAVAILABLE when none lives, NOT_FOUND (with the
models its backends hold) when none holds the model named.

The router serves gRPC's health checking: ``""`` and the split channel's service
are SERVING while a backend lives, and each model a live backend holds is
SERVING as ``<SplitChannel>/<model>``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.wire.limits import (
    CLIENT_ID_KEY,
    MODEL_KEY,
    SERVICE_NAME,
    ChannelLimits,
)
from splitfed.channel.engine.loop import LoopThread
from splitfed.channel.routing.backends import Backend, model_health_name
from splitfed.channel.routing.table import ANY_MODEL, RouteTable
from splitfed.errors import AuthError, ConfigError

__all__ = ["Router"]

log = logging.getLogger(__name__)

_SERVICE = pb.DESCRIPTOR.services_by_name["SplitChannel"]
#: Metadata the router never forwards (gRPC's own, set again on the backend call).
_DROP = frozenset({"user-agent", "content-type", "te", "host", "grpc-accept-encoding", "grpc-encoding"})
#: A retried call's attempt count, as gRPC sends it (reserved: forwarded as ``x-splitfed-retry``).
_ATTEMPTS = "grpc-previous-rpc-attempts"
_OPENS = frozenset({"OpenSession", "OpenRegion"})
_CLOSES = frozenset({"CloseSession", "CloseRegion"})
#: How long a model no backend holds is not asked about again.
_UNKNOWN_MODEL_TTL_S = 1.0


def _split(metadata: Sequence[tuple[str, Any]], peer: str) -> tuple[list[tuple[str, Any]], str, str]:
    """The metadata to forward, the client's key (its id, else a digest of its token, else its connection) and
    the model it names."""
    out: list[tuple[str, Any]] = []
    client = token = ""
    model = ANY_MODEL
    for key, value in metadata:
        if key == _ATTEMPTS:
            if value not in ("", "0"):
                out.append(("x-splitfed-retry", value))
            continue
        if key in _DROP or key.startswith((":", "grpc-")):
            continue
        out.append((key, value))
        if key == CLIENT_ID_KEY:
            client = value
        elif key == MODEL_KEY:
            model = value
        elif key == "authorization" and isinstance(value, str):
            token = value
    if not client:
        client = "token:" + hashlib.sha256(token.encode()).hexdigest()[:32] if token else "peer:" + peer
    return out, client, model


def _trailing(exc: grpc.aio.AioRpcError) -> tuple[tuple[str, Any], ...]:
    return tuple((k, v) for k, v in (exc.trailing_metadata() or ()) if not k.startswith((":", "grpc-")))


class Router:
    """One address in front of several trunk servers.

    Quickstart::

        router = Router(["127.0.0.1:50052", "127.0.0.1:50053"], port=50051, insecure=True).start()
        router.wait()

    Args:
        backends: ``host:port`` of each trunk server (order breaks ties between equally loaded ones).
        host, port: where to listen (port 0 picks a free one; see :attr:`port`).
        insecure: serve plaintext; required unless ``credentials`` are given.
        credentials: ``grpc.ServerCredentials`` for TLS towards the clients.
        backend_credentials: TLS towards the backends (None: plaintext).
        backend_options: extra channel options towards the backends (e.g. ``grpc.ssl_target_name_override``).
        metrics: a backend's Prometheus endpoint by its address: its trunk's memory breaks load ties.
        limits: message sizes (the backends' own).
        max_concurrent_rpcs: calls served at once; past it gRPC answers RESOURCE_EXHAUSTED.
        probe_interval_s: how often each backend's health is checked.
        sticky_idle_s: a client's pin holding no session or region ends after this long without a call.
        authenticate: checks each call's metadata (e.g. :meth:`splitfed.channel.security.tokens.StaticToken.authenticate`) before
            it is forwarded; an :class:`~splitfed.errors.AuthError` is answered UNAUTHENTICATED by the router.
        backend_token: sent to the backends as ``authorization: Bearer`` in place of the client's (None: the
            client's passes through).
        expected_down: ``expected_down(i)``: whether backend ``i`` going down was already reported by whoever
            runs it (a trunk replica set reports its replicas' ends): then one INFO line, else a WARNING.
    """

    def __init__(self, backends: Sequence[str], *, host: str = "127.0.0.1", port: int = 0, insecure: bool = False,
                 credentials: grpc.ServerCredentials | None = None,
                 backend_credentials: grpc.ChannelCredentials | None = None,
                 backend_options: Sequence[tuple[str, Any]] = (), metrics: Mapping[str, str] | None = None,
                 limits: ChannelLimits = ChannelLimits(), max_concurrent_rpcs: int = 4096,
                 probe_interval_s: float = 1.0, sticky_idle_s: float = 600.0,
                 authenticate: Callable[[dict[str, str]], str] | None = None, backend_token: str | None = None,
                 expected_down: Callable[[int], bool] | None = None) -> None:
        if not backends:
            raise ConfigError("a router needs at least one backend address")
        if credentials is None and not insecure:
            raise ConfigError("the router needs TLS credentials, or insecure=True to serve plaintext "
                              "(for loopback and tests)")
        if len(set(backends)) != len(backends):
            raise ConfigError(f"a backend is listed twice: {list(backends)}")
        metrics = dict(metrics or {})
        self.authenticate = authenticate
        self.expected_down = expected_down
        self._backend_auth = None if backend_token is None else ("authorization", f"Bearer {backend_token}")
        options = list(limits.grpc_options()) + list(backend_options)
        self.backends = [Backend(a, i, credentials=backend_credentials, options=options, metrics_url=metrics.get(a))
                         for i, a in enumerate(backends)]
        self.table = RouteTable([b.state for b in self.backends], sticky_idle_s=sticky_idle_s)
        self.limits = limits
        self.host = host
        self.probe_interval_s = probe_interval_s
        self._requested_port = port
        self._credentials = credentials
        self._max_concurrent_rpcs = max_concurrent_rpcs
        self._unknown: dict[str, float] = {}  # model -> when no backend held it
        self._published: set[str] = set()
        self.health: Any = None
        self.port = 0
        self._serving = LoopThread("splitfed-router", "the router")
        self._server: Any = None
        self._monitor: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        """``host:port`` the router listens on (after :meth:`start`)."""
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"

    # -- forwarding ----------------------------------------------------------------------------------
    async def _route(self, context: Any, method: str) -> tuple[Backend, list[tuple[str, Any]], str, str]:
        received = context.invocation_metadata() or ()
        if self.authenticate is not None:
            try:
                self.authenticate({k: v for k, v in received if isinstance(v, str)})
            except AuthError as exc:
                log.warning("UNAUTHENTICATED %s from %s: %s", method, context.peer(), exc)
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        out, client, model = _split(received, context.peer())
        if self._backend_auth is not None:
            out = [kv for kv in out if kv[0] != "authorization"] + [self._backend_auth]
        state = self.table.pick(client, model)
        if state is None and model != ANY_MODEL and any(b.state.live for b in self.backends):
            await self._learn(model)
            state = self.table.pick(client, model)
        if state is None:
            if not any(b.state.live for b in self.backends):
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    "no trunk server behind this router is reachable (backends: "
                                    f"{', '.join(b.address for b in self.backends)}); retry later")
            held = self.table.models()
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no trunk server behind this router holds model {model!r}; they hold: "
                                f"{', '.join(repr(m) for m in held) or 'no named model'}; name one of those in "
                                f"{MODEL_KEY}")
        assert state is not None
        log.debug("%s of %s (model %r) -> %s", method, client, model, state.address)
        return self.backends[state.index], out, client, model

    async def _learn(self, model: str) -> None:
        """Ask the live backends whether they serve ``model`` (at most once a second for a model none holds)."""
        if time.monotonic() - self._unknown.get(model, -1e9) < _UNKNOWN_MODEL_TTL_S:
            return
        found = await asyncio.gather(*(b.learn(model) for b in self.backends if b.state.live))
        if any(found):
            self._unknown.pop(model, None)
            await self._publish()
        else:
            self._unknown[model] = time.monotonic()

    def _settled(self, name: str, client: str, model: str) -> None:
        """Book what a successful call changes in the client's pin."""
        if name in _OPENS:
            self.table.opened(client, model)
        elif name in _CLOSES:
            self.table.closed(client, model)
        elif name == "Leave":
            self.table.left(client, model)

    def _failed(self, backend: Backend, exc: grpc.aio.AioRpcError) -> None:
        if exc.code() is grpc.StatusCode.UNAVAILABLE:  # a busy trunk says so too: the probe tells them apart
            asyncio.ensure_future(self._probe(backend))

    def _unary(self, name: str) -> grpc.RpcMethodHandler:
        method = f"/{SERVICE_NAME}/{name}"

        async def forward(request: bytes, context: Any) -> bytes:
            backend, out, client, model = await self._route(context, name)
            state, call = backend.state, None
            state.in_flight += 1
            try:
                call = backend.unary(method)(request, metadata=out, timeout=context.time_remaining())
                reply = await call
            except grpc.aio.AioRpcError as exc:
                self._failed(backend, exc)
                await context.abort(exc.code(), exc.details() or "", _trailing(exc))
            except asyncio.CancelledError:
                if call is not None:
                    call.cancel()
                raise
            finally:
                state.in_flight -= 1
            self._settled(name, client, model)
            return reply
        return grpc.unary_unary_rpc_method_handler(forward)

    def _stream(self, name: str) -> grpc.RpcMethodHandler:
        method = f"/{SERVICE_NAME}/{name}"

        async def forward(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
            backend, out, client, model = await self._route(context, name)

            async def pump() -> AsyncIterator[bytes]:
                async for frame in requests:
                    yield frame
            state = backend.state
            state.in_flight += 1
            call = backend.stream(method)(pump(), metadata=out, timeout=context.time_remaining())
            try:
                async for frame in call:
                    yield frame
            except grpc.aio.AioRpcError as exc:
                self._failed(backend, exc)
                await context.abort(exc.code(), exc.details() or "", _trailing(exc))
            finally:
                state.in_flight -= 1
                if not call.done():  # the client cancelled, or went away
                    call.cancel()
            self._settled(name, client, model)
        return grpc.stream_stream_rpc_method_handler(forward)

    def _handlers(self) -> grpc.GenericRpcHandler:
        handlers: dict[str, grpc.RpcMethodHandler] = {}
        for m in _SERVICE.methods:
            if m.client_streaming and m.server_streaming:
                handlers[m.name] = self._stream(m.name)
            elif not (m.client_streaming or m.server_streaming):
                handlers[m.name] = self._unary(m.name)
            else:  # the split channel has none; forwarding one would need its own handler kind
                raise ConfigError(f"the router cannot forward {m.name}: one-way streaming is not supported")
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

    # -- backends' health ------------------------------------------------------------------------------
    async def _probe(self, backend: Backend) -> None:
        was = backend.state.live
        if not await backend.probe() and was:
            moved = self.table.down(backend.state)
            expected = self.expected_down is not None and self.expected_down(backend.state.index)
            log.log(logging.INFO if expected else logging.WARNING, "trunk backend %s is down: %d pinned client(s) go "
                    "to the other backends at their next call", backend.address, moved)
            await self._publish()
        elif not was and backend.state.live:
            await self._publish()

    async def _watch(self) -> None:
        rounds = 0
        while True:
            await asyncio.sleep(self.probe_interval_s)
            await asyncio.gather(*(self._probe(b) for b in self.backends))
            rounds += 1
            if rounds % 5 == 0:
                await asyncio.gather(*(b.recheck_models() for b in self.backends if b.state.live))
                await self._publish()

    async def _publish(self) -> None:
        """The router's health: SERVING while a backend lives; each model a live backend holds."""
        if self.health is None:
            return
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        any_live = any(b.state.live for b in self.backends)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, serving if any_live else not_serving)
        models = set(self.table.models())
        for model in models | self._published:
            await self.health.set(model_health_name(model), serving if model in models else not_serving)
        self._published |= models

    # -- lifecycle ------------------------------------------------------------------------------------
    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        return self._serving.run(coro, timeout)

    def start(self) -> Router:
        """Bind, check every backend once, start serving; returns self. Backends that are down are logged and
        probed again every ``probe_interval_s``."""
        self._serving.start()
        try:
            self._run(self._start())
        except BaseException:
            self._serving.stop()
            raise
        live = [b.address for b in self.backends if b.state.live]
        log.info("router listening on %s (%s) in front of %s; live: %s", self.address,
                 "TLS" if self._credentials is not None else "plaintext",
                 ", ".join(b.address for b in self.backends), ", ".join(live) or "none yet")
        return self

    async def _start(self) -> None:
        server = grpc.aio.server(options=self.limits.grpc_options(), maximum_concurrent_rpcs=self._max_concurrent_rpcs)
        server.add_generic_rpc_handlers((self._handlers(),))
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        target = f"{self.host}:{self._requested_port}" if ":" not in self.host else \
            f"[{self.host.strip('[]')}]:{self._requested_port}"
        try:
            self.port = (server.add_secure_port(target, self._credentials) if self._credentials is not None
                         else server.add_insecure_port(target))
        except RuntimeError:
            self.port = 0
        if not self.port:
            raise ConfigError(f"could not bind the router to {target}; is the port in use?")
        for backend in self.backends:
            backend.open()
        await asyncio.gather(*(backend.probe() for backend in self.backends))
        await self._publish()
        await server.start()
        self._server = server
        self._monitor = asyncio.ensure_future(self._watch())

    def stats(self) -> list[dict[str, Any]]:
        """Each backend as the router sees it: address, live, models, calls in flight, clients pinned, held bytes."""
        async def read() -> list[dict[str, Any]]:
            return [{"address": b.address, "live": b.state.live, "models": sorted(b.state.models),
                     "in_flight": b.state.in_flight, "pinned": b.state.pinned, "held_bytes": b.state.held_bytes}
                     for b in self.backends]
        return self._run(read(), 10)

    def backend_of(self, client_id: str, model: str = ANY_MODEL) -> str | None:
        """The address ``client_id`` is pinned to for ``model`` (None: not pinned)."""
        async def read() -> str | None:
            state = self.table.pinned_to(client_id, model)
            return None if state is None else state.address
        return self._run(read(), 10)

    def stop(self, grace: float | None = 1.0) -> None:
        """Mark NOT_SERVING and stop; calls in flight get ``grace`` seconds."""
        if self._serving.loop is None or self._serving.stopped.is_set():
            return
        try:
            if self._server is not None:
                self._run(self._stop(grace))
        finally:
            self._serving.stop()
            self._serving.stopped.set()

    async def _stop(self, grace: float | None) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        await self.health.enter_graceful_shutdown()
        await self._server.stop(grace)
        await asyncio.gather(*(b.close() for b in self.backends))

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the router stops (or ``timeout``); returns True if it timed out."""
        return self._serving.wait(timeout)

    def __enter__(self) -> Router:
        return self.start() if not self.port else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
