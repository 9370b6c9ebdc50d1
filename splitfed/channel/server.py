"""The trunk server: the split channel's gRPC service (asyncio) around a trunk runtime and its scheduler.

:class:`TrunkServer` runs a ``grpc.aio`` server on an event loop of its own
thread, so callers keep a plain synchronous API (``start``, ``stop``,
``wait``). Handlers (:mod:`splitfed.channel.servicer`) await the futures of
the trunk's scheduler (:mod:`splitfed.trunk.scheduler`), whose single device
thread runs every forward, backward and optimizer step: waiting for a sync
step costs no thread, however many clients wait. The server also exposes
gRPC's standard health service and server reflection.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from torch import nn

from splitfed.channel.handlers import method_handlers, status_for
from splitfed.channel.regions import RegionTable
from splitfed.channel.regions import available as regions_available
from splitfed.channel.limits import (
    CLIENT_ID_KEY,
    RETRY_KEYS,
    SERVICE_NAME,
    ChannelLimits,
)
from splitfed.channel.servicer import SplitChannelServicer
from splitfed.errors import ConfigError
from splitfed.optim import make_optimizer
from splitfed.trunk.aggregation import TrunkAggregator
from splitfed.trunk.runtime import GradientGuard, TrunkRuntime
from splitfed.trunk.scheduler import TrunkScheduler
from splitfed.trunk.sessions import SessionLimits, SessionManager, supports_sessions
from splitfed.trunk.store import StoreLimits
from splitfed.tuning import tune_malloc

__all__ = ["CLIENT_ID_KEY", "RETRY_KEYS", "SERVICE_NAME", "ChannelLimits", "TrunkServer", "status_for"]

log = logging.getLogger(__name__)


def _bind_error(host: str, port: int) -> str:
    """Why ``host:port`` cannot be bound, in words that say what to do."""
    import errno
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.bind((host.strip("[]"), port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return (f"port {port} is in use (another trunk server?); stop what listens there or pick another port "
                    "(0: a free one)")
        return f"{exc.strerror or exc}; bind an address of this host (127.0.0.1, 0.0.0.0)"
    return "gRPC refused the address; check the host and port"


def _stop_at_exit(ref: weakref.ref[TrunkServer]) -> None:
    server = ref()
    if server is not None:
        server.stop(grace=0)


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
        max_concurrent_rpcs: calls served at once (waiting ones included); past it gRPC answers
            RESOURCE_EXHAUSTED. Waiting calls hold no thread, so this can be large.
        batch_window_ms, max_batch_tokens: cross-client batching of trunk forwards
            (see :class:`~splitfed.trunk.scheduler.TrunkScheduler`; 0 = off).
        checkpointing: activation checkpointing of the trunk (when ``trunk`` is a module).
        interceptors: ``grpc.aio.ServerInterceptor`` instances.
        sessions: serves inference sessions (default: a :class:`SessionManager` with
            ``session_limits`` for trunks that can hold a KV cache).
        shared_memory_bytes: bytes of shared memory each client on this host may map for its tensors
            (:mod:`splitfed.channel.regions`; 0: none, every tensor travels over the socket).
        shared_memory_total_bytes: bytes of shared memory all clients may map together.
        reuse_port: let other processes of this same server listen on ``port`` too (``SO_REUSEPORT``: the
            kernel spreads connections over them). Off (default), a port another process listens on is refused
            at :meth:`start`, so two servers never share a port by accident.
    """

    def __init__(self, trunk: nn.Module | TrunkRuntime, *, host: str = "127.0.0.1", port: int = 0,
                 insecure: bool = False, credentials: grpc.ServerCredentials | None = None,
                 optimizer: str = "sgd", lr: float = 0.01, momentum: float = 0.0, weight_decay: float = 0.0,
                 aggregator: TrunkAggregator | None = None, limits: ChannelLimits = ChannelLimits(),
                 store_limits: StoreLimits = StoreLimits(), guard: GradientGuard = GradientGuard(),
                 max_concurrent_rpcs: int = 4096, batch_window_ms: float = 0.0, max_batch_tokens: int = 1 << 16,
                 checkpointing: bool = False,
                 model_name: str = "", cuts: tuple[int, int] | None = None,
                 authenticate: Callable[[dict[str, str]], str] | None = None, sessions: Any = None,
                 interceptors: list[Any] | None = None,
                 session_limits: SessionLimits = SessionLimits(), metrics_port: int | None = None,
                 metrics_host: str = "127.0.0.1", shared_memory_bytes: int = 256 << 20,
                 shared_memory_total_bytes: int = 4 << 30, reuse_port: bool = False) -> None:
        tune_malloc()
        if credentials is None and not insecure:
            raise ConfigError("the trunk server needs TLS credentials, or insecure=True to serve plaintext "
                              "(for loopback and tests)")
        if max_concurrent_rpcs < 1:
            raise ConfigError(f"max_concurrent_rpcs must be >= 1, got {max_concurrent_rpcs}")
        if isinstance(trunk, TrunkRuntime):
            self.runtime = trunk
        else:
            trainable = [p for p in trunk.parameters() if p.requires_grad]
            opt = make_optimizer(optimizer, trainable, lr, momentum=momentum,
                                 weight_decay=weight_decay) if trainable else None
            self.runtime = TrunkRuntime(trunk, opt, aggregator=aggregator, limits=store_limits, guard=guard,
                                        checkpointing=checkpointing)
        self.runtime.host_outputs = True  # replies leave from host memory, copied on the device thread
        if sessions is None and supports_sessions(self.runtime.trunk):
            sessions = SessionManager.from_limits(self.runtime, session_limits)
        self.limits = limits
        self.host = host
        self._requested_port = port
        self._reuse_port = reuse_port
        self._credentials = credentials
        period = max(min(self.runtime.store.limits.ttl_s / 4, 10.0), 0.05)
        self.scheduler = TrunkScheduler(self.runtime, batch_window_ms=batch_window_ms,
                                        max_batch_tokens=max_batch_tokens, sweep_period_s=period,
                                        on_sweep=None if sessions is None else sessions.sweep)
        self.servicer = SplitChannelServicer(self.runtime, self.scheduler, limits, model_name=model_name, cuts=cuts,
                                             authenticate=authenticate, sessions=sessions)
        if shared_memory_bytes > 0 and shared_memory_total_bytes > 0 and regions_available():
            self.servicer.regions = RegionTable(shared_memory_bytes, shared_memory_total_bytes,
                                                pin=self.runtime.device.type == "cuda")
        self._interceptors = list(interceptors or [])
        self._max_concurrent_rpcs = max_concurrent_rpcs
        self.metrics: Any = None
        self._metrics_port, self._metrics_host, self.metrics_port = metrics_port, metrics_host, 0
        if metrics_port is not None:
            from splitfed.channel.metrics import TrunkMetrics

            self.metrics = TrunkMetrics()
            self.metrics.watch(self.runtime, sessions)
            self.runtime.aggregator.observer = self.metrics.observe_aggregator
            self.servicer.metrics = self.metrics
            self._interceptors.insert(0, self.metrics.interceptor())
        self.health: Any = None
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: Any = None
        self._stopped = threading.Event()

    @property
    def address(self) -> str:
        """``host:port`` the server listens on (after :meth:`start`)."""
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"

    # -- lifecycle -------------------------------------------------------------------------
    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self) -> TrunkServer:
        """Bind, start serving and mark the service SERVING; returns self."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="splitfed-trunk-grpc", daemon=True)
        self._thread.start()
        self.scheduler.start()
        try:
            self._run(self._start())
        except BaseException:
            self._shutdown_loop()
            self.scheduler.stop()
            raise
        if self.metrics is not None:
            self.metrics_port = self.metrics.serve(self._metrics_port or 0, self._metrics_host)
        # A script that ends without stop(): stop before the interpreter tears gRPC down under a live server.
        atexit.register(_stop_at_exit, weakref.ref(self))
        log.info("trunk server listening on %s (%s, %s)", self.address,
                 "TLS" if self._credentials is not None else "plaintext", self.runtime.aggregator.describe())
        return self

    async def _start(self) -> None:
        # gRPC turns SO_REUSEPORT on by default: a second server on a busy port would bind and share it silently.
        options = self.limits.grpc_options() + [("grpc.so_reuseport", int(self._reuse_port))]
        server = grpc.aio.server(options=options, interceptors=self._interceptors,
                                 maximum_concurrent_rpcs=self._max_concurrent_rpcs)
        server.add_generic_rpc_handlers((method_handlers(self.servicer),))
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        target = f"{self.host}:{self._requested_port}" if ":" not in self.host else \
            f"[{self.host.strip('[]')}]:{self._requested_port}"
        try:
            if self._credentials is not None:
                self.port = server.add_secure_port(target, self._credentials)
            else:
                self.port = server.add_insecure_port(target)
        except RuntimeError:
            self.port = 0
        if not self.port:
            await server.stop(None)  # never started: release it on this loop, and drop it (the traceback would
            del server               # keep this frame, and the server's __del__ would run at interpreter exit)
            why = _bind_error(self.host, self._requested_port)
            raise ConfigError(f"could not bind the trunk server to {target}: {why}")
        await server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server = server

    def stop(self, grace: float | None = 1.0) -> None:
        """Mark NOT_SERVING and stop; in-flight RPCs get ``grace`` seconds."""
        if self._loop is None or self._stopped.is_set():
            return
        try:
            if self._server is not None:
                self._run(self._stop(grace))
        finally:
            self.scheduler.stop()
            self._shutdown_loop()
            if self.servicer.regions is not None:
                self.servicer.regions.close_all()
            if self.metrics is not None:
                self.metrics.stop()
            self._stopped.set()

    async def _stop(self, grace: float | None) -> None:
        await self.health.enter_graceful_shutdown()
        await self._server.stop(grace)

    def _shutdown_loop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        if not loop.is_running():
            loop.close()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stops (or ``timeout``); returns True if it timed out."""
        return not self._stopped.wait(timeout)

    def __enter__(self) -> TrunkServer:
        return self.start() if not self.port else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
