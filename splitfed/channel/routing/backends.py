"""A router's connection to one trunk server: its gRPC channel, whether it lives, which models it holds, its load.

Liveness is gRPC's health check of the backend (service ``""``): a backend is
live while it answers SERVING, and down from the first probe that finds it
unreachable or not serving, or after :data:`MISSES` probes in a row that time out. The models it holds come from its ``Info`` (a server holding one model
names it there) and, for a model a call names that no backend is known to
hold, from the backend's per-model health service (``<SplitChannel>/<model>``,
which a server holding several models reports). Where the backend exports
Prometheus metrics, the bytes its trunk holds between requests
(``splitfed_held_bytes``) are read at every probe and break ties between
equally loaded backends.

Concurrency: everything here runs on the router's event loop; the metrics are
read in the loop's default executor (a blocking HTTP request).
"""

from __future__ import annotations

import asyncio
import logging
import urllib.request
from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.wire.limits import SERVICE_NAME
from splitfed.channel.routing.table import ANY_MODEL, BackendState

log = logging.getLogger(__name__)

_SERVING = health_pb2.HealthCheckResponse.SERVING
#: Health checks in a row that may time out before a backend that answered before counts as down (a refused
#: connection or NOT_SERVING counts at once).
MISSES = 3


def model_health_name(model: str) -> str:
    """The health-checking service name of one model on a trunk server."""
    return f"{SERVICE_NAME}/{model}"


def _held_bytes(text: str) -> int | None:
    """The sum of ``splitfed_held_bytes`` in a Prometheus text exposition (None: not there)."""
    from prometheus_client.parser import text_string_to_metric_families

    total, seen = 0.0, False
    for family in text_string_to_metric_families(text):
        if family.name == "splitfed_held_bytes":
            for sample in family.samples:
                total += sample.value
                seen = True
    return int(total) if seen else None


class Backend:
    """One trunk server behind a router.

    Args:
        address: ``host:port`` of the trunk server.
        index: its position (ties between equally loaded backends go to the lower one).
        credentials: TLS to reach it (None: plaintext).
        options: gRPC channel options (message sizes, a TLS target name override).
        metrics_url: its Prometheus endpoint (``http://host:port/metrics``), read for its memory; None: unknown.
        probe_timeout_s: how long one health check may take.
    """

    def __init__(self, address: str, index: int, *, credentials: grpc.ChannelCredentials | None = None,
                 options: Sequence[tuple[str, Any]] = (), metrics_url: str | None = None,
                 probe_timeout_s: float = 1.0) -> None:
        self.state = BackendState(address, index)
        self.address = address
        self.metrics_url = metrics_url
        self.probe_timeout_s = probe_timeout_s
        self._credentials = credentials
        self._options = list(options) + [("grpc.enable_retries", 0)]  # the client retries, through the router
        self.channel: Any = None
        self._methods: dict[str, Any] = {}
        self._health: Any = None
        self._info: Any = None
        self._named: frozenset[str] = frozenset()  # the model its Info names
        self._probing: asyncio.Task[bool] | None = None
        self._misses = 0

    def open(self) -> None:
        """Create the channel (on the router's event loop: aio channels belong to the loop that made them)."""
        self.channel = (grpc.aio.secure_channel(self.address, self._credentials, options=self._options)
                        if self._credentials is not None
                        else grpc.aio.insecure_channel(self.address, options=self._options))
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._info = self.channel.unary_unary(f"/{SERVICE_NAME}/Info",
                                              request_serializer=pb.InfoRequest.SerializeToString,
                                              response_deserializer=pb.InfoReply.FromString)

    async def close(self) -> None:
        """Close the channel (calls in flight end CANCELLED)."""
        if self._probing is not None:
            self._probing.cancel()
        if self.channel is not None:
            await self.channel.close()

    def unary(self, method: str) -> Any:
        """The bytes-in, bytes-out unary call ``method`` (``/package.Service/Name``)."""
        call = self._methods.get(method)
        if call is None:
            call = self._methods[method] = self.channel.unary_unary(method)
        return call

    def stream(self, method: str) -> Any:
        """The bytes-in, bytes-out bidirectional streaming call ``method``."""
        call = self._methods.get(method)
        if call is None:
            call = self._methods[method] = self.channel.stream_stream(method)
        return call

    # -- probes --------------------------------------------------------------------------------------
    async def _check(self, service: str) -> int | grpc.StatusCode:
        """The health status of ``service``, or the status code of the check that failed."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                             timeout=self.probe_timeout_s)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return int(reply.status)

    async def probe(self) -> bool:
        """Check the backend now (one probe at a time; a caller arriving during one awaits it); returns whether
        it lives. On its way up its models are read from its Info."""
        if self._probing is None or self._probing.done():
            self._probing = asyncio.ensure_future(self._probe())
        return await asyncio.shield(self._probing)

    async def _probe(self) -> bool:
        state = self.state
        answer = await self._check("")
        live = answer == _SERVING
        if not live and state.live and answer is grpc.StatusCode.DEADLINE_EXCEEDED:
            # slow, not gone (a loaded host): down only after MISSES probes in a row
            self._misses += 1
            if self._misses < MISSES:
                log.debug("health check of %s timed out (%d of %d)", self.address, self._misses, MISSES)
                return True
        self._misses = 0
        if live and not state.live:
            self._named = await self._models()
            state.models = self._named
            log.info("trunk backend %s is up (models: %s)", self.address,
                     ", ".join(sorted(m for m in state.models if m)) or "unnamed")
        elif not live and state.live:
            log.debug("trunk backend %s is down", self.address)  # the router says so, and what it does about it
        state.live = live
        if live and self.metrics_url:
            state.held_bytes = await asyncio.get_running_loop().run_in_executor(None, self._scrape)
        return live

    async def _models(self) -> frozenset[str]:
        """The model its Info names (a server holding several names none without ``x-splitfed-model``)."""
        try:
            reply = await self._info(pb.InfoRequest(), timeout=self.probe_timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.debug("Info of %s: %s (its models are learned per name)", self.address, exc.code().name)
            return frozenset()
        return frozenset({reply.model} if reply.model else ())

    async def learn(self, model: str) -> bool:
        """Ask the backend whether it serves ``model`` (its per-model health service); remembers a yes."""
        if model == ANY_MODEL or model in self.state.models:
            return True
        if not self.state.live:
            return False
        if await self._check(model_health_name(model)) == _SERVING:
            self.state.models = self.state.models | {model}
            log.info("trunk backend %s serves model %r", self.address, model)
            return True
        return False

    async def recheck_models(self) -> None:
        """Forget models learned from per-model health that the backend no longer serves (unloaded)."""
        learned = self.state.models - self._named
        if not learned:
            return
        kept = {m for m in learned if await self._check(model_health_name(m)) == _SERVING}
        self.state.models = self._named | kept

    def _scrape(self) -> int | None:
        assert self.metrics_url is not None
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=self.probe_timeout_s) as reply:
                return _held_bytes(reply.read().decode("utf-8", "replace"))
        except (OSError, ValueError) as exc:
            log.debug("metrics of %s unreadable: %s", self.address, exc)
            return None
