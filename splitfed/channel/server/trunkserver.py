"""The trunk server: the split channel's gRPC service (asyncio) in front of one or several models.

:class:`TrunkServer` runs a ``grpc.aio`` server on an event loop of its own
thread, so callers keep a plain synchronous API (``start``, ``stop``,
``wait``, ``load``, ``unload``). Each model is a unit
(:mod:`splitfed.channel.server.units`): its trunk runtime, its scheduler, whose single
device thread runs every forward, backward and optimizer step of that model,
its servicer, sessions and shared-memory regions. Handlers await the
scheduler's futures: waiting for a sync step costs no thread, however many
clients wait. A generic handler (:mod:`splitfed.channel.server.dispatch`) hands each
call to the model its ``x-splitfed-model`` metadata names (a server holding one
model also serves calls that name none). The models share the port, the TLS
credentials, the clients' token check, gRPC's health service (each model is
its own service, ``splitfed.v1.SplitChannel/<model>``, SERVING once loaded),
server reflection, and the metrics endpoint (series labelled ``model``). The
model admin service (:mod:`splitfed.channel.admin`, a token of its own) lists,
loads, unloads and reloads models while the others serve
(:mod:`splitfed.channel.server.registry`). How the server takes calls in (its own
``grpc.aio`` server or front-end processes) is :mod:`splitfed.channel.server.listeners`;
its health reporting :mod:`splitfed.channel.server.health`.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import ssl
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import grpc
from grpc_health.v1 import health
from torch import nn

from splitfed.channel.server.admin import AdminServicer, admin_handlers, check_admin_token
from splitfed.channel.transports.bulk.hub import BulkHub, host_memory
from splitfed.channel.transports.direct.server import DirectCalls, start_direct
from splitfed.channel.server.dispatch import ModelDispatch
from splitfed.channel.server.handlers import status_for
from splitfed.channel.security.hosts import is_loopback
from splitfed.channel.wire.limits import (
    CLIENT_ID_KEY,
    MODEL_KEY,
    RETRY_KEYS,
    SERVICE_NAME,
    ChannelLimits,
)
from splitfed.channel.server.listeners import build_frontends, start_grpc_server
from splitfed.channel.engine.loop import LoopThread
from splitfed.channel.server.health import health_name, report_models, report_state
from splitfed.channel.server.registry import Entry, ModelRegistry
from splitfed.channel.server.units import ModelState, ModelUnit, ServerOptions, build_unit
from splitfed.errors import ConfigError, ResourceExhaustedError
from splitfed.serving.devices import check_budget_devices, check_spec_devices
from splitfed.serving.memory import MemoryBudget
from splitfed.serving.spec import ModelSpec
from splitfed.trunk.aggregation.modes import TrunkAggregator
from splitfed.trunk.compute.runtime import GradientGuard, TrunkRuntime
from splitfed.trunk.scheduler import TrunkScheduler
from splitfed.trunk.inference.sessions import SessionLimits
from splitfed.trunk.compute.store import StoreLimits
from splitfed.tuning import freeze_heap, serving_thresholds, thaw_heap, tune_malloc

__all__ = ["CLIENT_ID_KEY", "MODEL_KEY", "RETRY_KEYS", "SERVICE_NAME", "ChannelLimits", "TrunkServer", "health_name",
           "status_for"]

log = logging.getLogger(__name__)


def _stop_at_exit(ref: weakref.ref[TrunkServer]) -> None:
    server = ref()
    if server is not None:
        server.stop(grace=0)


class TrunkServer:
    """Serves one model's trunk, or several models, over the split channel.

    Quickstart::

        server = TrunkServer(parts.trunk, lr=0.01, port=50051, insecure=True).start()
        server.wait()

    Several models::

        server = TrunkServer(models=[ModelSpec("mnist-cnn"), ModelSpec("/models/llama", cuts=(2, 10))],
                             insecure=True, admin_token=token, max_memory={"cpu": 8 << 30}).start()

    Args:
        trunk: a trunk module or a ready :class:`TrunkRuntime`, served as the model ``model_name``;
            None: only the models of ``models`` (and those loaded later).
        host, port: where to listen (port 0 picks a free one; see :attr:`port`).
        insecure: serve plaintext; required unless ``credentials`` are given.
        credentials: ``grpc.ServerCredentials`` for TLS.
        optimizer, lr, momentum, weight_decay: the trunk's optimizer when ``trunk`` is a module.
        aggregator: sync (default), async or quorum; see :mod:`splitfed.trunk.aggregation.modes`.
        limits: message sizes; store_limits: saved-forward TTL and budget.
        max_concurrent_rpcs: calls served at once (waiting ones included); past it gRPC answers
            RESOURCE_EXHAUSTED. Waiting calls hold no thread, so this can be large.
        batch_window_ms, max_batch_tokens: cross-client batching of trunk forwards
            (see :class:`~splitfed.trunk.scheduler.TrunkScheduler`; 0 = off).
        checkpointing: activation checkpointing of the trunk (when ``trunk`` is a module).
        compile: compile the trunk's blocks with ``torch.compile`` (when ``trunk`` is a module; see
            :mod:`splitfed.trunk.compute.compiled`).
        model_name, cuts: the name and cuts of ``trunk`` (reported by Info; the name is what clients ask for).
        authenticate: the clients' token check, shared by every model.
        interceptors: ``grpc.aio.ServerInterceptor`` instances.
        sessions: serves inference sessions (default: a :class:`SessionManager` with
            ``session_limits`` for trunks that can hold a KV cache).
        metrics_port, metrics_host: the Prometheus endpoint (None: none).
        shared_memory_bytes: bytes of shared memory each client on this host may map for its tensors
            (:mod:`splitfed.channel.transports.shm.regions`; 0: none, every tensor travels over the socket).
        shared_memory_total_bytes: bytes of shared memory all clients of one model may map together.
        models: models to load when the server starts (each on the loader thread; :meth:`start` returns once
            all are READY and raises if one fails). One whose estimate does not fit ``max_memory`` is refused
            alone: listed FAILED with the reason while the others serve (:meth:`start` raises only when no model
            is left). A device this machine lacks (``cuda:N``) is a ConfigError here, before anything starts.
        admin_token: the model admin service's token (at least 16 characters; never a client's). None: the
            service refuses every call. Off loopback, only with TLS.
        max_memory: bytes per device (``cpu``, ``cuda:N``, ``*`` for any) the models may take; a load whose
            estimate does not fit is refused with RESOURCE_EXHAUSTED before anything is allocated.
        frontends: take calls in with this many front-end processes (:mod:`splitfed.channel.engine.frontend`) sharing
            the port, each handing its calls to this process's handlers over a local link: gRPC's per-call work
            then runs on several cores (0: this process's event loop takes every call in).
        frontend_tls: with ``frontends`` and TLS, the server's key and certificate chain and the CA whose client
            certificates it requires (PEM bytes; None for none): the front-ends build their credentials from them.
        reuse_port: let other processes of this same server listen on ``port`` too (``SO_REUSEPORT``: the
            kernel spreads connections over them). Off (default), a port another process listens on is refused
            at :meth:`start`, so two servers never share a port by accident.
        bulk_connections: offer bulk links of up to this many TCP connections (:mod:`splitfed.channel.transports.bulk.links`):
            a client that asks for one sends and receives the bytes of its streamed calls over them instead of
            gRPC chunks (0: none). Not with ``frontends``.
        bulk_tls: a TLS server's bulk links (an ``ssl.SSLContext`` from
            :func:`~splitfed.channel.security.bulktls.server_context`, with the gRPC server's certificate chain, key and
            client CA); required with ``credentials`` and ``bulk_connections``.
        bulk_port: the port bulk links listen on (0: a free one; sent to each client in ``OpenBulk``'s reply).
        direct_calls: offer each client that opens a shared-memory region a Unix socket of this process on which
            its region-carried Forward and Backward calls skip gRPC and the front-ends (:mod:`splitfed.channel.transports.direct.server`).
    """

    def __init__(self, trunk: nn.Module | TrunkRuntime | None = None, *, host: str = "127.0.0.1", port: int = 0,
                 insecure: bool = False, credentials: grpc.ServerCredentials | None = None,
                 optimizer: str = "sgd", lr: float = 0.01, momentum: float = 0.0, weight_decay: float = 0.0,
                 aggregator: TrunkAggregator | None = None, limits: ChannelLimits = ChannelLimits(),
                 store_limits: StoreLimits = StoreLimits(), guard: GradientGuard = GradientGuard(),
                 max_concurrent_rpcs: int = 4096, batch_window_ms: float = 0.0, max_batch_tokens: int = 1 << 16,
                 checkpointing: bool = False, compile: bool = False,
                 model_name: str = "", cuts: tuple[int, int] | None = None,
                 authenticate: Callable[[dict[str, str]], str] | None = None, sessions: Any = None,
                 interceptors: list[Any] | None = None,
                 session_limits: SessionLimits = SessionLimits(), metrics_port: int | None = None,
                 metrics_host: str = "127.0.0.1", shared_memory_bytes: int = 256 << 20,
                 shared_memory_total_bytes: int = 4 << 30, models: Iterable[ModelSpec] = (),
                 admin_token: str | None = None, max_memory: Mapping[str, int] | None = None,
                 frontends: int = 0, frontend_tls: tuple[bytes, bytes, bytes | None] | None = None,
                 reuse_port: bool = False, bulk_connections: int = 0, bulk_tls: ssl.SSLContext | None = None,
                 bulk_port: int = 0, direct_calls: bool = True) -> None:
        tune_malloc()
        serving_thresholds()  # a malformed SPLITFED_GC_THRESHOLDS fails here, before anything starts
        if credentials is None and not insecure:
            raise ConfigError("the trunk server needs TLS credentials, or insecure=True to serve plaintext "
                              "(for loopback and tests)")
        if max_concurrent_rpcs < 1:
            raise ConfigError(f"max_concurrent_rpcs must be >= 1, got {max_concurrent_rpcs}")
        if frontends < 0:
            raise ConfigError(f"frontends must be >= 0, got {frontends}")
        if frontends and credentials is not None and frontend_tls is None:
            raise ConfigError("front-end processes serve TLS from PEM files: pass frontend_tls=(key, chain, client_ca) "
                              "with the credentials (splitfed serve does)")
        if bulk_connections < 0:
            raise ConfigError(f"bulk_connections must be >= 0, got {bulk_connections}")
        if not 0 <= bulk_port <= 65535:
            raise ConfigError(f"bulk_port must be in 0..65535, got {bulk_port}")
        if bulk_connections and (credentials is None) != (bulk_tls is None):
            raise ConfigError("a TLS server's bulk links need TLS too: pass bulk_tls=server_context(chain, key, "
                              "client_ca) from splitfed.channel.security.bulktls, built from the PEM files of the credentials"
                              if credentials is not None else
                              "bulk_tls is for a TLS server: pass its credentials too, or drop bulk_tls")
        if bulk_connections and frontends:
            raise ConfigError("bulk links and front-end processes exclude each other: set one of bulk_connections "
                              "and frontends")
        models = list(models)
        check_spec_devices(models)  # a GPU this machine lacks: refused before anything starts or loads
        check_budget_devices(max_memory or {})
        self._froze = False  # whether start() froze the heap (splitfed.tuning)
        self._frontend_count = frontends
        self._frontend_tls = frontend_tls
        self.frontends: Any = None
        self._admin_token = check_admin_token(admin_token)
        if self._admin_token is not None and credentials is None and not is_loopback(host):
            raise ConfigError(f"the admin service's token would cross the network in the clear on {host}: serve "
                              "with TLS (--tls-cert, --tls-key) or bind a loopback address")
        self.limits = limits
        self.host = host
        self._requested_port = port
        self._reuse_port = reuse_port
        self._credentials = credentials
        self._interceptors = list(interceptors or [])
        self._max_concurrent_rpcs = max_concurrent_rpcs
        self.health: Any = None
        self._updates: set[asyncio.Future[None]] = set()
        self.port = 0
        self._serving = LoopThread("splitfed-trunk-grpc", "the trunk server")
        self._server: Any = None
        self.metrics: Any = None
        self._metrics_port, self._metrics_host, self.metrics_port = metrics_port, metrics_host, 0
        if metrics_port is not None:
            from splitfed.channel.server.metrics import TrunkMetrics

            self.metrics = TrunkMetrics()
            self._interceptors.insert(0, self.metrics.interceptor())
        self.bulk = None if not bulk_connections else BulkHub(
            host, max_connections=bulk_connections, max_bytes=limits.max_tensor_bytes,
            max_pending_bytes=2 * limits.max_tensor_bytes + limits.max_message_bytes, alloc=host_memory(),
            tls=bulk_tls, port=bulk_port)
        self.direct = DirectCalls(limits.max_message_bytes) if direct_calls and shared_memory_bytes > 0 else None
        self.options = ServerOptions(limits, authenticate, shared_memory_total_bytes, session_limits, self.bulk,
                                     self.direct)
        self.registry = ModelRegistry(self.options, MemoryBudget(max_memory), on_state=self._on_state,
                                      on_ready=self._on_ready)
        if self.metrics is not None:
            self.metrics.model_of = self.registry.label
        self._initial = models
        if trunk is not None:
            self.registry.add(build_unit(
                model_name, trunk, self.options, optimizer=optimizer, lr=lr, momentum=momentum,
                weight_decay=weight_decay, aggregator=aggregator, store_limits=store_limits, guard=guard,
                checkpointing=checkpointing, compile=compile, cuts=cuts, batch_window_ms=batch_window_ms,
                max_batch_tokens=max_batch_tokens, sessions=sessions, shared_memory_bytes=shared_memory_bytes))

    @property
    def address(self) -> str:
        """``host:port`` the server listens on (after :meth:`start`)."""
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"

    # -- the models ------------------------------------------------------------------------
    def unit(self, name: str | None = None) -> ModelUnit:
        """Model ``name``'s unit (None: the only model's); ConfigError when there is no such READY unit."""
        entries = self.registry.entries
        if name is None:
            if len(entries) != 1:
                raise ConfigError(f"this server holds {len(entries)} models ({', '.join(sorted(entries))}); name one: "
                                  "server.unit(name)")
            (entry,) = entries.values()
        else:
            found = entries.get(name)
            if found is None:
                raise ConfigError(f"this server does not hold model {name!r}; it holds {sorted(entries)}")
            entry = found
        if entry.unit is None:
            raise ConfigError(f"model {entry.name!r} is {entry.state.value}, not loaded")
        return entry.unit

    @property
    def runtime(self) -> TrunkRuntime:
        """The only model's trunk runtime."""
        return self.unit().runtime

    @property
    def scheduler(self) -> TrunkScheduler:
        """The only model's scheduler."""
        return self.unit().scheduler

    @property
    def servicer(self) -> Any:
        """The only model's split-channel servicer."""
        return self.unit().servicer

    def models(self) -> dict[str, ModelState]:
        """Each model's state, by name."""
        return {name: entry.state for name, entry in sorted(self.registry.entries.items())}

    def load(self, spec: ModelSpec, *, wait: bool = True, timeout: float | None = None) -> Entry:
        """Load a model while serving the others (see :meth:`ModelRegistry.load`)."""
        return self._run(self.registry.load(spec, wait=wait), timeout)

    def unload(self, name: str, *, drain_timeout_s: float = 30.0) -> Entry:
        """Unload a model: its calls in flight finish, new ones get UNAVAILABLE, its sessions are closed."""
        return self._run(self.registry.unload(name, drain_timeout_s=drain_timeout_s))

    def reload(self, name: str, spec: ModelSpec | None = None, *, wait: bool = True) -> Entry:
        """Unload a model and load it again from its source (or ``spec``)."""
        return self._run(self.registry.reload(name, spec, wait=wait))

    def _on_ready(self, unit: ModelUnit) -> None:
        if self.metrics is not None:
            unit.attach_metrics(self.metrics)

    def _on_state(self, name: str, state: ModelState | None) -> None:
        if self.health is not None and self._serving.running:
            update = asyncio.ensure_future(report_state(self.health, self.registry, name, state))
            self._updates.add(update)  # the loop keeps only weak references to tasks
            update.add_done_callback(self._updates.discard)

    # -- lifecycle -------------------------------------------------------------------------
    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        return self._serving.run(coro, timeout)

    def start(self) -> TrunkServer:
        """Bind, start serving, mark the service SERVING and load ``models``; returns self."""
        if self._admin_token is not None:  # models may load while it serves: their libraries' first import now
            from splitfed.serving.build import preload_libraries

            preload_libraries()
        self._serving.start()
        for entry in self.registry.entries.values():
            if entry.unit is not None:
                entry.unit.start()
        self.registry.pending = {spec.name for spec in self._initial}  # told to retry until they load
        try:
            if self.bulk is not None:
                self.bulk.start()
            self._run(self._start())
            if self.metrics is not None:
                self.metrics_port = self.metrics.serve(self._metrics_port or 0, self._metrics_host)
            refused: list[ResourceExhaustedError] = []
            for spec in self._initial:
                try:
                    self.load(spec)
                except ResourceExhaustedError as exc:  # beyond the memory budget: this model only, the rest serve
                    self._run(self.registry.refuse(spec, f"refused at start-up: {exc}"))
                    refused.append(exc)
            if refused and not any(e.state is ModelState.READY for e in self.registry.entries.values()):
                raise refused[0]  # nothing left to serve
        except BaseException:
            self.stop(grace=0)
            raise
        # A script that ends without stop(): stop before the interpreter tears gRPC down under a live server.
        atexit.register(_stop_at_exit, weakref.ref(self))
        self._froze = freeze_heap()  # no full collection walks the libraries' and models' objects while serving
        log.info("trunk server listening on %s (%s), models: %s", self.address,
                 "TLS" if self._credentials is not None else "plaintext",
                 "; ".join(f"{name or '(unnamed)'}: {e.unit.runtime.aggregator.describe()}"
                           for name, e in sorted(self.registry.entries.items()) if e.unit is not None) or "none")
        return self

    async def _start(self) -> None:
        calls = ModelDispatch(self.registry.route)
        handlers = (calls, admin_handlers(AdminServicer(self.registry, self._admin_token)))
        self.health = health.aio.HealthServicer()
        if self._frontend_count:  # front-end processes take the calls in, this process's handlers run them
            self.frontends, dispatch = build_frontends(
                handlers, self.health, count=self._frontend_count, host=self.host, port=self._requested_port,
                reuse_port=self._reuse_port, limits=self.limits, interceptors=self._interceptors,
                max_concurrent_rpcs=self._max_concurrent_rpcs, tls=self._frontend_tls)
            self.port = await self.frontends.start(dispatch)
        else:
            self._server, self.port = await start_grpc_server(
                handlers, self.health, host=self.host, port=self._requested_port, credentials=self._credentials,
                limits=self.limits, interceptors=self._interceptors, max_concurrent_rpcs=self._max_concurrent_rpcs,
                reuse_port=self._reuse_port)
        await start_direct(self.direct, (calls,), self._interceptors)
        await report_models(self.health, self.registry)

    def stop(self, grace: float | None = 1.0) -> None:
        """Mark NOT_SERVING and stop; in-flight RPCs get ``grace`` seconds, then every model stops."""
        if self._serving.loop is None or self._serving.stopped.is_set():
            return
        try:
            if self._server is not None or self.frontends is not None:
                self._run(self._stop(grace))
            else:
                self._run(self.registry.close())
        finally:
            if self.bulk is not None:
                self.bulk.close()
            self._serving.stop()
            if self.metrics is not None:
                self.metrics.stop()
            if self._froze:  # this server's objects are collectable again once its owner drops it
                thaw_heap()
            self._serving.stopped.set()

    async def _stop(self, grace: float | None) -> None:
        await self.health.enter_graceful_shutdown()
        if self.direct is not None:
            await self.direct.stop()
        if self.frontends is not None:
            await self.frontends.stop()
        if self._server is not None:
            await self._server.stop(grace)
        await self.registry.close()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stops (or ``timeout``); returns True if it timed out."""
        return self._serving.wait(timeout)

    def __enter__(self) -> TrunkServer:
        return self.start() if not self.port else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
