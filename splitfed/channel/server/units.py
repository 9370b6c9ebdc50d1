"""One served model: its runtime, scheduler (device thread), servicer, inference sessions and shared-memory regions.

A trunk server holds one :class:`ModelUnit` per model (:mod:`splitfed.channel.server.registry`) and hands each
call to the unit its ``x-splitfed-model`` metadata names (:mod:`splitfed.channel.server.dispatch`). Nothing is shared
between units but the server's port, credentials, token check, health service and metrics registry: each has
its own saved forwards, sessions, optimizer, regions and device thread, so one model's state never mixes with
another's. :func:`build_unit` makes a unit from a trunk module, a runtime or a
:class:`~splitfed.serving.spec.ModelSpec`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import torch
from torch import nn

from splitfed.channel.server.handlers import method_handlers
from splitfed.channel.wire.limits import ChannelLimits
from splitfed.channel.transports.shm.regions import RegionTable
from splitfed.channel.transports.shm.regions import available as regions_available
from splitfed.channel.server.servicer import SplitChannelServicer
from splitfed.errors import TrunkBusyError
from splitfed.serving.memory import Estimate, held_bytes
from splitfed.serving.spec import ModelSpec
from splitfed.trunk.aggregation.modes import TrunkAggregator
from splitfed.trunk.compute.runtime import GradientGuard, TrunkRuntime
from splitfed.trunk.scheduler import TrunkScheduler
from splitfed.trunk.inference.sessions import SessionLimits, SessionManager, supports_sessions
from splitfed.trunk.compute.store import StoreLimits

log = logging.getLogger(__name__)


class ModelState(str, enum.Enum):
    """Where a model stands on its server."""

    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    FAILED = "FAILED"


@dataclass(frozen=True)
class ServerOptions:
    """What every unit of one server shares: message sizes, the token check, region bounds."""

    limits: ChannelLimits = ChannelLimits()
    authenticate: Callable[[dict[str, str]], str] | None = None
    shared_memory_total_bytes: int = 4 << 30
    session_limits: SessionLimits = SessionLimits()
    #: The server's bulk links (a :class:`~splitfed.channel.transports.bulk.hub.BulkHub`; None: it offers none).
    bulk: Any = None
    #: The server's direct-call socket (a :class:`~splitfed.channel.transports.direct.server.DirectCalls`; None: it offers none).
    direct: Any = None


class ModelUnit:
    """One model's serving path. Calls in flight are counted by the dispatcher, so that an unload can drain them.

    Args:
        name: the model's name on the server ("" for the unnamed model of a one-model server).
        runtime: its trunk runtime.
        options: what the server's units share.
        cuts: the blocks the trunk holds (reported by Info).
        batch_window_ms, max_batch_tokens: the scheduler's batching.
        sessions: the inference-session manager (default: one when the trunk can hold a KV cache).
        shared_memory_bytes: bytes of shared memory each client on this host may map for this model.
        spec: how the model was loaded (None for a unit built from a module).
        estimate: its estimated bytes (None when not estimated).
    """

    def __init__(self, name: str, runtime: TrunkRuntime, options: ServerOptions = ServerOptions(), *,
                 cuts: tuple[int, int] | None = None, batch_window_ms: float = 0.0,
                 max_batch_tokens: int = 1 << 16, sessions: Any = None, shared_memory_bytes: int = 256 << 20,
                 spec: ModelSpec | None = None, estimate: Estimate | None = None) -> None:
        self.name = name
        self.spec = spec
        self.estimate = estimate
        self.cuts = cuts
        self.runtime = runtime
        # Replies leave from host memory: small ones copied on the device thread, large ones on a GPU by the copy
        # engine while the device thread goes on (see TrunkRuntime.handed and deliver).
        runtime.host_outputs = True
        if sessions is None and supports_sessions(runtime.trunk):
            sessions = SessionManager.from_limits(runtime, options.session_limits)
        self.sessions = sessions
        period = max(min(runtime.store.limits.ttl_s / 4, 10.0), 0.05)
        self.scheduler = TrunkScheduler(runtime, batch_window_ms=batch_window_ms, max_batch_tokens=max_batch_tokens,
                                        sweep_period_s=period, on_sweep=None if sessions is None else sessions.sweep)
        runtime.defer = self._defer  # a batch's backward runs on the device thread
        self.servicer = SplitChannelServicer(runtime, self.scheduler, options.limits, model_name=name, cuts=cuts,
                                             authenticate=options.authenticate, sessions=sessions)
        self.servicer.bulk = options.bulk
        self.servicer.direct = options.direct
        if shared_memory_bytes > 0 and options.shared_memory_total_bytes > 0 and regions_available():
            self.servicer.regions = RegionTable(shared_memory_bytes, options.shared_memory_total_bytes,
                                                pin=runtime.device.type == "cuda")
        self.handler: grpc.GenericRpcHandler = method_handlers(self.servicer)
        #: Its methods' handlers as the dispatcher wraps them (made once per method: see channel.dispatch).
        self.tracked: dict[str, grpc.RpcMethodHandler] = {}
        self.state = ModelState.READY
        self.in_flight = 0
        self.calls: set[asyncio.Task[Any]] = set()  # the handler tasks of calls in flight (cancelled past a drain)
        self.metrics: Any = None

    def _defer(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the device thread (its failures are logged: the work reports its own errors)."""
        def done(future: Any) -> None:
            error = future.exception()
            if error is not None and not isinstance(error, TrunkBusyError):
                log.error("deferred trunk work of model %s failed: %r", self.name, error, exc_info=error)
        self.scheduler.call(fn).add_done_callback(done)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> ModelUnit:
        """Start the device thread; returns self."""
        self.scheduler.start()
        return self

    def attach_metrics(self, metrics: Any) -> None:
        """Report this model's calls, tensors, steps and state to ``metrics`` (a TrunkMetrics), labelled."""
        view = metrics.for_model(self.name)
        self.servicer.metrics = view
        self.runtime.aggregator.observer = view.observe_aggregator
        metrics.watch(self.runtime, self.sessions, model=self.name)
        self.metrics = metrics

    def close(self, why: str = "") -> None:
        """Close its sessions (told ``why``), stop the device thread, close its regions, leave the metrics."""
        sessions = self.sessions
        if sessions is not None and why and callable(getattr(sessions, "close_all", None)) and \
                self.scheduler.running:
            try:  # on the device thread: no step is running then
                self.scheduler.call(lambda: sessions.close_all(why)).result(10)
            except Exception:  # noqa: BLE001 - the unit goes away whatever happens
                log.exception("closing the sessions of model %s failed", self.name)
        self.scheduler.stop()
        self.servicer.close()
        if self.servicer.regions is not None:
            self.servicer.regions.close_all()
        if self.metrics is not None:
            self.metrics.unwatch(self.name)
            self.metrics = None

    # -- state ---------------------------------------------------------------------------------
    def held_bytes(self) -> dict[str, int]:
        """Bytes its trunk holds now, by device (weights, buffers, gradients, optimizer state)."""
        return held_bytes(self.runtime.trunk, self.runtime.optimizer)

    @property
    def trunk_mode(self) -> str:
        """The aggregator's mode (sync, async, quorum, ...)."""
        return str(self.runtime.aggregator.mode)


def build_unit(name: str, trunk: nn.Module | TrunkRuntime, options: ServerOptions = ServerOptions(), *,
               optimizer: str = "sgd", lr: float = 0.01, momentum: float = 0.0, weight_decay: float = 0.0,
               aggregator: TrunkAggregator | None = None, store_limits: StoreLimits = StoreLimits(),
               guard: GradientGuard = GradientGuard(), checkpointing: bool = False, compile: bool = False,
               cuts: tuple[int, int] | None = None, batch_window_ms: float = 0.0, max_batch_tokens: int = 1 << 16,
               sessions: Any = None, shared_memory_bytes: int = 256 << 20) -> ModelUnit:
    """A unit around a trunk module (with an optimizer over its trainable parameters) or a ready runtime."""
    from splitfed.serving.build import make_runtime

    runtime = trunk if isinstance(trunk, TrunkRuntime) else make_runtime(
        trunk, optimizer=optimizer, lr=lr, momentum=momentum, weight_decay=weight_decay, aggregator=aggregator,
        store_limits=store_limits, guard=guard, checkpointing=checkpointing, compile=compile)
    return ModelUnit(name, runtime, options, cuts=cuts, batch_window_ms=batch_window_ms,
                     max_batch_tokens=max_batch_tokens, sessions=sessions, shared_memory_bytes=shared_memory_bytes)


def unit_from_spec(spec: ModelSpec, options: ServerOptions, estimate: Estimate | None = None) -> ModelUnit:
    """Read and build ``spec``'s model and its unit (the slow part of a load: run it off the event loop)."""
    from splitfed.serving.build import build_model

    built = build_model(spec)
    return ModelUnit(spec.name, built.runtime, options, cuts=built.cuts, batch_window_ms=spec.batch_window_ms,
                     max_batch_tokens=spec.max_batch_tokens, shared_memory_bytes=spec.shared_memory_mib << 20,
                     spec=spec, estimate=estimate)


def release_memory(device: str) -> None:
    """Give freed device memory back (after a unit's last reference went)."""
    from splitfed.tuning import collect_all

    collect_all()
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()
