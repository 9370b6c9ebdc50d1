"""Prometheus metrics of the trunk server (prometheus-client), served over HTTP.

Names follow Prometheus conventions (``splitfed_`` prefix, ``_total`` counters,
``_seconds`` and ``_bytes`` units). Labels have bounded cardinality: RPC method,
status code, direction, wire dtype, gradient outcome, and ``model``: the name of
the model a series is about, on a server that holds several (only names the
server holds or held; empty for a server's only unnamed model and for calls that
name no model it holds). Client ids are never labels.

* An interceptor counts every RPC by method and status and times it.
* The servicer reports tensor bytes received and sent per wire dtype.
* The aggregator reports its barrier waits, bucket (quorum) sizes and staleness
  through an observer callback (the aggregation code stays free of Prometheus).
* A collector reads the runtime's gauges and counters at scrape time: saved
  forwards and their bytes, evictions, trunk version and steps, gradient outcomes,
  step-group members, inference sessions and KV-cache bytes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from typing import Any

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from splitfed.channel.wire.limits import MODEL_KEY

log = logging.getLogger(__name__)

_CODES = {c.value[0]: c for c in grpc.StatusCode}
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class TrunkMetrics:
    """The trunk server's metrics in their own registry; :meth:`serve` exposes them over HTTP.

    ``model_of(metadata)`` names the model a call is for (its ``model`` label); by default the
    ``x-splitfed-model`` metadata. A server holding several models sets it to a lookup that answers only names
    it holds, so that clients cannot mint labels.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes, CPU seconds, open fds
        self.rpcs = Counter("splitfed_rpc", "RPCs handled, by method, status code and model",
                            ["method", "code", "model"], registry=r)
        self.rpc_seconds = Histogram("splitfed_rpc_seconds", "RPC handling time, by method and model",
                                     ["method", "model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.wire_bytes = Counter("splitfed_wire_bytes", "Tensor payload bytes on the split channel",
                                  ["direction", "dtype", "model"], registry=r)
        self.retries = Counter("splitfed_retried_requests", "Requests that arrived as gRPC retries",
                               ["method", "model"], registry=r)
        self.sync_wait = Histogram("splitfed_step_wait_seconds", "Time a gradient waited for its step "
                                   "(sync barrier or quorum)", ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.bucket_size = Histogram("splitfed_step_gradients", "Gradients combined per trunk step (quorum size)",
                                     ["model"], buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=r)
        self.staleness = Histogram("splitfed_gradient_staleness", "Trunk versions between a forward and its "
                                   "gradient's update", ["model"], buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32),
                                   registry=r)
        self.epsilon = Gauge("splitfed_dp_epsilon", "Differential-privacy epsilon spent so far (max over clients; "
                             "NaN when DP is off)", registry=r)
        self.epsilon.set(float("nan"))
        self.model_of: Callable[[Mapping[str, str]], str] = lambda md: md.get(MODEL_KEY, "")
        self._watched = _RuntimeCollector()
        r.register(self._watched)
        self._http: Any = None

    # -- wiring ---------------------------------------------------------------------------------
    def for_model(self, model: str) -> ModelMetrics:
        """The servicer's and the aggregator's hooks for one model's series."""
        return ModelMetrics(self, model)

    def observe_aggregator(self, kind: str, value: float, model: str = "") -> None:
        """The aggregator's observer callback."""
        if kind == "wait_seconds":
            self.sync_wait.labels(model).observe(value)
        elif kind == "bucket_size":
            self.bucket_size.labels(model).observe(value)
        elif kind == "staleness":
            self.staleness.labels(model).observe(value)

    def tensors(self, direction: str, encs: Iterable[Any], model: str = "") -> None:
        """Count the payload bytes of encoded tensors (``direction``: received or sent)."""
        for enc in encs:
            self.wire_bytes.labels(direction, enc.dtype.name.lower() if hasattr(enc.dtype, "name")
                                   else str(enc.dtype), model).inc(getattr(enc, "wire_nbytes", len(enc.data)))

    def watch(self, runtime: Any, sessions: Any = None, model: str = "") -> None:
        """Expose the runtime's (and the session manager's) state at scrape time, labelled ``model``."""
        for method in ("Forward", "Backward", "ForwardStream", "BackwardStream"):  # export zeros from the start
            self.retries.labels(method, model)
            self.rpcs.labels(method, "OK", model)
        for histogram in (self.sync_wait, self.bucket_size, self.staleness):
            histogram.labels(model)
        self._watched.add(model, runtime, sessions)

    def unwatch(self, model: str) -> None:
        """Stop exposing ``model``'s runtime state (it was unloaded); its counters keep their last values."""
        self._watched.remove(model)

    def set_epsilon(self, value: float) -> None:
        """Report the privacy spent so far (set by the ServerApp from the clients' round metrics)."""
        self.epsilon.set(value)

    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Start the HTTP endpoint (``/metrics``); returns its port."""
        self._http, _ = start_http_server(port, addr=addr, registry=self.registry)
        bound = int(self._http.server_port)
        log.info("Prometheus metrics at http://%s:%d/metrics", addr, bound)
        return bound

    def stop(self) -> None:
        """Stop the HTTP endpoint."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        """A server interceptor that counts and times every RPC."""
        return _MetricsInterceptor(self)


class ModelMetrics:
    """One model's view of :class:`TrunkMetrics`: what its servicer and aggregator report, labelled."""

    def __init__(self, metrics: TrunkMetrics, model: str) -> None:
        self.metrics = metrics
        self.model = model

    def tensors(self, direction: str, encs: Iterable[Any]) -> None:
        """Count the payload bytes of encoded tensors (``direction``: received or sent)."""
        self.metrics.tensors(direction, encs, self.model)

    def observe_aggregator(self, kind: str, value: float) -> None:
        """The aggregator's observer callback."""
        self.metrics.observe_aggregator(kind, value, self.model)


class _MetricsInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: TrunkMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method.rsplit("/", 1)[-1]
        metrics = self.metrics
        md = {k: v for k, v in (details.invocation_metadata or ()) if isinstance(v, str)}
        model = metrics.model_of(md)
        attempts = md.get("grpc-previous-rpc-attempts") or md.get("x-splitfed-retry")
        if attempts not in (None, "", "0"):
            metrics.retries.labels(method, model).inc()
            log.warning("retried request: %s (previous attempts: %s)", method, attempts)

        def record(context: Any, start: float, outcome: str) -> None:
            code = context.code()
            if isinstance(code, int):
                code = _CODES.get(code)
            if outcome == "cancelled" or context.cancelled():
                name = "CANCELLED"
            elif code is None or (code is grpc.StatusCode.OK and outcome != "ok"):
                name = "OK" if outcome == "ok" else "UNKNOWN"
            else:
                name = code.name
            metrics.rpcs.labels(method, name, model).inc()
            metrics.rpc_seconds.labels(method, model).observe(time.perf_counter() - start)

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request: Any, context: Any) -> Any:
                start, outcome = time.perf_counter(), "failed"
                try:
                    response = await inner(request, context)
                    outcome = "ok"
                    return response
                except asyncio.CancelledError:
                    outcome = "cancelled"
                    raise
                finally:
                    record(context, start, outcome)

            return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=handler.request_deserializer,
                                                       response_serializer=handler.response_serializer)
        if handler.stream_stream is not None:
            inner_stream = handler.stream_stream

            async def stream(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
                start, outcome = time.perf_counter(), "failed"
                try:
                    async for reply in inner_stream(requests, context):
                        yield reply
                    outcome = "ok"
                except asyncio.CancelledError:
                    outcome = "cancelled"
                    raise
                finally:
                    record(context, start, outcome)

            return grpc.stream_stream_rpc_method_handler(stream, request_deserializer=handler.request_deserializer,
                                                         response_serializer=handler.response_serializer)
        return handler


class _RuntimeCollector(Collector):
    """Reads each watched model's runtime state when Prometheus scrapes: one family per metric, one sample per
    model."""

    def __init__(self) -> None:
        self._models: dict[str, tuple[Any, Any]] = {}

    def add(self, model: str, runtime: Any, sessions: Any = None) -> None:
        self._models = {**self._models, model: (runtime, sessions)}  # replaced whole: scrapes read a snapshot

    def remove(self, model: str) -> None:
        self._models = {k: v for k, v in self._models.items() if k != model}

    def describe(self) -> Iterator[Any]:
        return iter(())  # families appear with the first model

    def collect(self) -> Iterator[Any]:
        models = self._models
        if not models:
            return

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=[*labels, "model"])

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=[*labels, "model"])

        saved = gauge("splitfed_saved_forwards", "Forwards held for their backward")
        saved_bytes = gauge("splitfed_saved_forward_bytes", "Bytes held by saved forwards")
        held = gauge("splitfed_held_bytes", "Bytes the trunk holds between requests, by kind (all count against "
                     "the saved-state budget)", ("kind",))
        evictions = counter("splitfed_evictions", "Saved forwards evicted (TTL or client left)")
        version = gauge("splitfed_trunk_version", "Optimizer steps the trunk has taken")
        steps = counter("splitfed_trunk_steps", "Trunk optimizer steps")
        outcomes = counter("splitfed_gradients", "Client gradients by outcome", ("outcome",))
        dropped = counter("splitfed_dropped_members", "Clients dropped from a step after its timeout")
        failed = counter("splitfed_failed_steps", "Trunk steps that failed (none of their gradients applied)")
        members = gauge("splitfed_step_group_members", "Clients in the trunk's step group")
        forwards = counter("splitfed_forwards", "Trunk forwards (training and evaluation)")
        recomputed = counter("splitfed_recomputed_forwards", "Stale forwards recomputed on the weights they saw")
        sessions_open = gauge("splitfed_inference_sessions", "Open inference sessions")
        kv = gauge("splitfed_kv_cache_bytes", "Bytes held by inference KV caches")
        session_steps = counter("splitfed_inference_steps", "Inference session steps")
        evicted = counter("splitfed_sessions_evicted", "Inference sessions evicted when idle")
        batched = counter("splitfed_batched_decode_steps", "Session steps run in batched decode calls")
        any_sessions = False
        for model, (rt, sessions) in models.items():
            saved.add_metric([model], len(rt.store))
            saved_bytes.add_metric([model], rt.store.forward_bytes)
            held.add_metric(["forwards", model], rt.store.forward_bytes)
            held.add_metric(["frozen-weights", model], rt.store.frozen_bytes)
            held.add_metric(["answers", model], rt.store.done_bytes)
            evictions.add_metric([model], rt.store.evicted)
            version.add_metric([model], rt.version)
            agg = rt.aggregator
            steps.add_metric([model], agg.stats.get("steps", 0))
            for name in ("applied", "downweighted", "rejected-stale", "rejected-guard"):
                outcomes.add_metric([name, model], agg.stats.get(name, 0))
            dropped.add_metric([model], agg.stats.get("dropped-members", 0))
            failed.add_metric([model], agg.stats.get("failed-steps", 0))
            members.add_metric([model], len(agg.members))
            forwards.add_metric([model], rt.stats.get("forwards", 0))
            recomputed.add_metric([model], rt.stats.get("recomputed", 0))
            if sessions is not None:
                any_sessions = True
                state = sessions.describe()
                sessions_open.add_metric([model], state["open"])
                kv.add_metric([model], state["bytes_held"])
                session_steps.add_metric([model], state["steps"])
                evicted.add_metric([model], state["evicted_idle"])
                batched.add_metric([model], state.get("batched_steps", 0))
        yield from (saved, saved_bytes, held, evictions, version, steps, outcomes, dropped, failed, members, forwards,
                    recomputed)
        if any_sessions:
            yield from (sessions_open, kv, session_steps, evicted, batched)
