"""Prometheus metrics of the trunk server (prometheus-client), served over HTTP.

Names follow Prometheus conventions (``splitfed_`` prefix, ``_total`` counters,
``_seconds`` and ``_bytes`` units). Labels have bounded cardinality: RPC method,
status code, direction, wire dtype, gradient outcome. Client ids are never labels.

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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
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

log = logging.getLogger(__name__)

_CODES = {c.value[0]: c for c in grpc.StatusCode}
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class TrunkMetrics:
    """The trunk server's metrics in their own registry; :meth:`serve` exposes them over HTTP."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes, CPU seconds, open fds
        self.rpcs = Counter("splitfed_rpc", "RPCs handled, by method and status code", ["method", "code"],
                            registry=r)
        self.rpc_seconds = Histogram("splitfed_rpc_seconds", "RPC handling time, by method", ["method"],
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.wire_bytes = Counter("splitfed_wire_bytes", "Tensor payload bytes on the split channel",
                                  ["direction", "dtype"], registry=r)
        self.retries = Counter("splitfed_retried_requests", "Requests that arrived as gRPC retries", ["method"],
                               registry=r)
        self.sync_wait = Histogram("splitfed_step_wait_seconds", "Time a gradient waited for its step "
                                   "(sync barrier or quorum)", buckets=_LATENCY_BUCKETS, registry=r)
        self.bucket_size = Histogram("splitfed_step_gradients", "Gradients combined per trunk step (quorum size)",
                                     buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=r)
        self.staleness = Histogram("splitfed_gradient_staleness", "Trunk versions between a forward and its "
                                   "gradient's update", buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32), registry=r)
        for method in ("Forward", "Backward", "ForwardStream", "BackwardStream"):  # export zeros from the start
            self.retries.labels(method)
            self.rpcs.labels(method, "OK")
        self.epsilon = Gauge("splitfed_dp_epsilon", "Differential-privacy epsilon spent so far (max over clients; "
                             "NaN when DP is off)", registry=r)
        self.epsilon.set(float("nan"))
        self._http: Any = None

    # -- wiring ---------------------------------------------------------------------------------
    def observe_aggregator(self, kind: str, value: float) -> None:
        """The aggregator's observer callback."""
        if kind == "wait_seconds":
            self.sync_wait.observe(value)
        elif kind == "bucket_size":
            self.bucket_size.observe(value)
        elif kind == "staleness":
            self.staleness.observe(value)

    def tensors(self, direction: str, encs: Iterable[Any]) -> None:
        """Count the payload bytes of encoded tensors (``direction``: received or sent)."""
        for enc in encs:
            self.wire_bytes.labels(direction, enc.dtype.name.lower() if hasattr(enc.dtype, "name")
                                   else str(enc.dtype)).inc(getattr(enc, "wire_nbytes", len(enc.data)))

    def watch(self, runtime: Any, sessions: Any = None) -> None:
        """Expose the runtime's (and the session manager's) state at scrape time."""
        self.registry.register(_RuntimeCollector(runtime, sessions))

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


class _MetricsInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: TrunkMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method.rsplit("/", 1)[-1]
        metrics = self.metrics
        md = dict(details.invocation_metadata or ())
        attempts = md.get("grpc-previous-rpc-attempts") or md.get("x-splitfed-retry")
        if attempts not in (None, "", "0"):
            metrics.retries.labels(method).inc()
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
            metrics.rpcs.labels(method, name).inc()
            metrics.rpc_seconds.labels(method).observe(time.perf_counter() - start)

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
    """Reads the trunk runtime's state when Prometheus scrapes."""

    def __init__(self, runtime: Any, sessions: Any = None) -> None:
        self.runtime = runtime
        self.sessions = sessions

    def collect(self) -> Iterator[Any]:
        rt = self.runtime
        yield GaugeMetricFamily("splitfed_saved_forwards", "Forwards held for their backward", value=len(rt.store))
        yield GaugeMetricFamily("splitfed_saved_forward_bytes", "Bytes held by saved forwards",
                                value=rt.store.forward_bytes)
        held = GaugeMetricFamily("splitfed_held_bytes", "Bytes the trunk holds between requests, by kind (all "
                                 "count against the saved-state budget)", labels=["kind"])
        held.add_metric(["forwards"], rt.store.forward_bytes)
        held.add_metric(["frozen-weights"], rt.store.frozen_bytes)
        held.add_metric(["answers"], rt.store.done_bytes)
        yield held
        yield CounterMetricFamily("splitfed_evictions", "Saved forwards evicted (TTL or client left)",
                                  value=rt.store.evicted)
        yield GaugeMetricFamily("splitfed_trunk_version", "Optimizer steps the trunk has taken", value=rt.version)
        agg = rt.aggregator
        yield CounterMetricFamily("splitfed_trunk_steps", "Trunk optimizer steps", value=agg.stats.get("steps", 0))
        outcomes = CounterMetricFamily("splitfed_gradients", "Client gradients by outcome", labels=["outcome"])
        for name in ("applied", "downweighted", "rejected-stale", "rejected-guard"):
            outcomes.add_metric([name], agg.stats.get(name, 0))
        yield outcomes
        yield CounterMetricFamily("splitfed_dropped_members", "Clients dropped from a step after its timeout",
                                  value=agg.stats.get("dropped-members", 0))
        yield CounterMetricFamily("splitfed_failed_steps", "Trunk steps that failed (none of their gradients "
                                  "applied)", value=agg.stats.get("failed-steps", 0))
        yield GaugeMetricFamily("splitfed_step_group_members", "Clients in the trunk's step group",
                                value=len(agg.members))
        yield CounterMetricFamily("splitfed_forwards", "Trunk forwards (training and evaluation)",
                                  value=rt.stats.get("forwards", 0))
        yield CounterMetricFamily("splitfed_recomputed_forwards", "Stale forwards recomputed on the weights they saw",
                                  value=rt.stats.get("recomputed", 0))
        sessions = self.sessions
        if sessions is not None:
            state = sessions.describe()
            yield GaugeMetricFamily("splitfed_inference_sessions", "Open inference sessions", value=state["open"])
            yield GaugeMetricFamily("splitfed_kv_cache_bytes", "Bytes held by inference KV caches",
                                    value=state["bytes_held"])
            yield CounterMetricFamily("splitfed_inference_steps", "Inference session steps", value=state["steps"])
            yield CounterMetricFamily("splitfed_sessions_evicted", "Inference sessions evicted when idle",
                                      value=state["evicted_idle"])
            yield CounterMetricFamily("splitfed_batched_decode_steps", "Session steps run in batched decode calls",
                                      value=state.get("batched_steps", 0))
