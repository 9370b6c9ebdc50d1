"""A trunk server's front-end process: takes gRPC calls in on the server's port and hands them to the engine.

``TrunkServer(..., frontends=N)`` starts N of these (:class:`Frontends`), all bound to the server's port
(``SO_REUSEPORT``: the kernel spreads new connections over them); the engine then takes no call on the port
itself. Each runs a ``grpc.aio`` server whose every
method of the split channel (and of the model admin service) forwards the call's bytes, metadata and peer over
an :class:`~splitfed.channel.engine.link.EngineLink` and answers with what the engine's handlers return: the
same bytes, the same status and message. The front-end decodes nothing; gRPC's per-call work (HTTP/2, TLS,
its asyncio machinery) runs here, on a core of its own, instead of on the engine's single event loop
(``docs/performance.md``, *Many clients on one GPU*).

Health: ``Check`` is forwarded (each model's status is the engine's); ``Watch`` is not served by a front-end
(``UNIMPLEMENTED``). When the engine goes away, the front-end stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_reflection.v1alpha import reflection

from splitfed.channel.engine.link import STREAMED, EngineLink, LinkClosed
from splitfed.tuning import freeze_heap

log = logging.getLogger(__name__)

HEALTH_SERVICE = "grpc.health.v1.Health"


@dataclass(frozen=True)
class FrontendConfig:
    """What a front-end process needs (passed by its parent at spawn; plain values only)."""

    host: str
    port: int
    link_path: str
    secret: str
    options: tuple[tuple[str, Any], ...]
    max_concurrent_rpcs: int
    services: tuple[str, ...]
    max_body: int
    #: TLS: the server's key and certificate chain (PEM), and the CA whose client certificates it requires
    #: (None: none required); None: plaintext.
    tls: tuple[bytes, bytes, bytes | None] | None = None
    log_level: int = logging.WARNING


def _status(name: str) -> grpc.StatusCode:
    try:
        return grpc.StatusCode[name]
    except KeyError:
        return grpc.StatusCode.INTERNAL


class _Forward(grpc.GenericRpcHandler):
    """Forwards every method of ``services`` (and health's ``Check``) to the engine."""

    def __init__(self, link: EngineLink, services: tuple[str, ...], max_body: int) -> None:
        self.link = link
        self.services = set(services)
        self.max_body = max_body

    def service(self, handler_call_details: Any) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        service, _, name = method.lstrip("/").partition("/")
        if service == HEALTH_SERVICE:
            return grpc.unary_unary_rpc_method_handler(self._unary(method)) if name == "Check" else None
        if service not in self.services:
            return None
        if name in STREAMED:
            return grpc.stream_stream_rpc_method_handler(self._streamed(method))
        return grpc.unary_unary_rpc_method_handler(self._unary(method))

    async def _hand_over(self, method: str, messages: list[bytes], context: Any) -> list[bytes]:
        try:
            reply, out = await self.link.call(method, context.invocation_metadata() or (), context.peer(), messages,
                                              context.time_remaining())
        except LinkClosed as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the trunk server is shutting down ({exc}); retry")
        if reply.get("code") != "OK":
            await context.abort(_status(str(reply.get("code"))), str(reply.get("details", "")))
        return out

    def _unary(self, method: str) -> Any:
        async def run(request: bytes, context: Any) -> bytes:
            out = await self._hand_over(method, [request], context)
            if len(out) != 1:
                await context.abort(grpc.StatusCode.INTERNAL, f"the engine answered {method} with {len(out)} replies")
            return out[0]
        return run

    def _streamed(self, method: str) -> Any:
        async def run(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
            messages, total = [], 0
            async for message in requests:
                total += len(message)
                if total > self.max_body:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"streamed request exceeds {self.max_body} bytes")
                messages.append(message)
            for reply in await self._hand_over(method, messages, context):
                yield reply
        return run


async def _serve(config: FrontendConfig, ready: Any) -> None:
    link = EngineLink(config.link_path, config.secret, config.max_body)
    await link.connect()
    server = grpc.aio.server(options=list(config.options) + [("grpc.so_reuseport", 1)],
                             maximum_concurrent_rpcs=config.max_concurrent_rpcs)
    server.add_generic_rpc_handlers((_Forward(link, config.services, config.max_body),))
    reflection.enable_server_reflection((*config.services, HEALTH_SERVICE, reflection.SERVICE_NAME), server)
    target = f"[{config.host.strip('[]')}]:{config.port}" if ":" in config.host else f"{config.host}:{config.port}"
    if config.tls is not None:
        key, chain, client_ca = config.tls
        credentials = grpc.ssl_server_credentials([(key, chain)], root_certificates=client_ca,
                                                  require_client_auth=client_ca is not None)
        port = server.add_secure_port(target, credentials)
    else:
        port = server.add_insecure_port(target)
    if not port:
        ready.put(("error", f"a front-end could not bind {target}"))
        return
    await server.start()
    freeze_heap()  # see splitfed.tuning: no full collection walks the imported libraries while serving
    ready.put(("ok", port))
    await link.closed.wait()  # the engine is gone: stop
    await server.stop(1.0)


def serve(config: FrontendConfig, ready: Any) -> None:
    """A front-end process's entry point: serve until the engine goes away (or the process is ended)."""
    logging.basicConfig(level=config.log_level)
    try:
        asyncio.run(_serve(config, ready))
    except Exception as exc:  # noqa: BLE001 - the parent reports it and does not start
        ready.put(("error", repr(exc)))
        raise


class Frontends:
    """The front-end processes of one trunk server, started and stopped by it (on its event loop).

    The first binds the requested port (0: a free one), the others the same port; the engine itself then takes
    no call on it: every call comes over the link.
    """

    def __init__(self, count: int, host: str, port: int, options: list[tuple[str, Any]], max_concurrent_rpcs: int,
                 services: tuple[str, ...], max_body: int, tls: tuple[bytes, bytes, bytes | None] | None = None,
                 start_timeout_s: float = 120.0) -> None:
        if count < 1:
            raise ValueError(f"front-ends must be >= 1, got {count}")
        self.count = count
        self.host = host
        self.port = port
        self.options = tuple(options)
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self.services = services
        self.max_body = max_body
        self.tls = tls
        self.start_timeout_s = start_timeout_s
        self.processes: list[Any] = []
        self.listener: Any = None
        self._dir: str | None = None

    async def start(self, dispatch: Any) -> int:
        """Listen for the front-ends, start them; returns the port they serve on. Raises :class:`ConfigError`
        when one cannot start (a busy port, say), after ending the others."""
        import multiprocessing as mp
        import os
        import secrets
        import tempfile

        from splitfed.channel.engine.link import EngineListener
        from splitfed.errors import ConfigError

        self._dir = tempfile.mkdtemp(prefix="splitfed-engine-")
        os.chmod(self._dir, 0o700)
        path = os.path.join(self._dir, "link.sock")
        secret = secrets.token_hex(32)
        self.listener = EngineListener(path, secret, dispatch, self.max_body)
        await self.listener.start()
        ctx = mp.get_context("spawn")
        ready = ctx.Queue()
        loop = asyncio.get_running_loop()
        port = self.port
        for i in range(self.count):
            config = FrontendConfig(self.host, port, path, secret, self.options, self.max_concurrent_rpcs,
                                    self.services, self.max_body, self.tls, logging.getLogger().level)
            process = ctx.Process(target=serve, args=(config, ready), name=f"splitfed-frontend-{i}", daemon=True)
            process.start()
            self.processes.append(process)
            try:
                status, value = await loop.run_in_executor(None, ready.get, True, self.start_timeout_s)
            except Exception:  # queue.Empty: it never answered
                status, value = "error", f"front-end {i} did not start within {self.start_timeout_s:.0f} s"
            if status != "ok":
                await self.stop()
                raise ConfigError(f"the trunk server's front-end processes could not start: {value}")
            port = int(value)
        self.port = port
        log.info("%d front-end processes serve %s:%d", self.count, self.host, port)
        return port

    def alive(self) -> int:
        """Front-end processes still running."""
        return sum(p.is_alive() for p in self.processes)

    async def stop(self) -> None:
        """End the front-ends, then stop listening for them."""
        import shutil

        for process in self.processes:
            if process.is_alive():
                process.terminate()
        loop = asyncio.get_running_loop()
        for process in self.processes:
            await loop.run_in_executor(None, process.join, 10)
            if process.is_alive():
                process.kill()
        if self.listener is not None:
            await self.listener.stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
