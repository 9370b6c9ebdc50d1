"""How the trunk server takes calls in: a ``grpc.aio`` server on its port, or front-end processes sharing it.

Both serve the same generic handlers and health service; a port that cannot be
bound is refused with a :class:`~splitfed.errors.ConfigError` that says why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from splitfed.channel.server.admin import SERVICE as ADMIN_SERVICE
from splitfed.channel.wire.limits import SERVICE_NAME, ChannelLimits
from splitfed.errors import ConfigError

if TYPE_CHECKING:
    from splitfed.channel.engine.calls import EngineDispatch
    from splitfed.channel.engine.frontend import Frontends

__all__ = ["bind_error", "build_frontends", "start_grpc_server"]


def bind_error(host: str, port: int, probe_only: bool = False) -> str:
    """Why ``host:port`` cannot be bound, in words that say what to do ("" with ``probe_only`` when it can)."""
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
    return "" if probe_only else "gRPC refused the address; check the host and port"


async def start_grpc_server(handlers: tuple[grpc.GenericRpcHandler, ...], health_servicer: Any, *, host: str,
                            port: int, credentials: grpc.ServerCredentials | None, limits: ChannelLimits,
                            interceptors: list[Any], max_concurrent_rpcs: int,
                            reuse_port: bool) -> tuple[Any, int]:
    """Start a ``grpc.aio`` server with ``handlers``, health and reflection on ``host:port``; returns it and its
    port. Raises :class:`ConfigError` saying why when the port cannot be bound."""
    # gRPC turns SO_REUSEPORT on by default: a second server on a busy port would bind and share it silently.
    options = limits.grpc_options() + [("grpc.so_reuseport", int(reuse_port))]
    server = grpc.aio.server(options=options, interceptors=interceptors,
                             maximum_concurrent_rpcs=max_concurrent_rpcs)
    server.add_generic_rpc_handlers(handlers)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, ADMIN_SERVICE, health.SERVICE_NAME,
                                         reflection.SERVICE_NAME), server)
    target = f"{host}:{port}" if ":" not in host else f"[{host.strip('[]')}]:{port}"
    try:
        if credentials is not None:
            bound = server.add_secure_port(target, credentials)
        else:
            bound = server.add_insecure_port(target)
    except RuntimeError:
        bound = 0
    if not bound:
        await server.stop(None)  # never started: release it on this loop, and drop it (the traceback would
        del server               # keep this frame, and the server's __del__ would run at interpreter exit)
        why = bind_error(host, port)
        raise ConfigError(f"could not bind the trunk server to {target}: {why}")
    await server.start()
    return server, bound


def build_frontends(handlers: tuple[grpc.GenericRpcHandler, ...], health_servicer: Any, *, count: int, host: str,
                    port: int, reuse_port: bool, limits: ChannelLimits, interceptors: list[Any],
                    max_concurrent_rpcs: int,
                    tls: tuple[bytes, bytes, bytes | None] | None) -> tuple[Frontends, EngineDispatch]:
    """``count`` front-end processes that take the calls in on ``host:port`` and the dispatch that runs them on
    ``handlers`` in this process (start them with ``frontends.start(dispatch)``)."""
    from splitfed.channel.engine.calls import EngineDispatch
    from splitfed.channel.engine.frontend import Frontends

    if port and not reuse_port:
        why = bind_error(host, port, probe_only=True)
        if why:  # the front-ends bind with SO_REUSEPORT among themselves: refuse a port someone else holds
            raise ConfigError(f"could not bind the trunk server to {host}:{port}: {why}")
    dispatch, collected = EngineDispatch.collecting()
    collected.add_generic_rpc_handlers(handlers)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, collected)
    dispatch.interceptors = list(interceptors)
    frontends = Frontends(count, host, port, limits.grpc_options(), max_concurrent_rpcs,
                          (SERVICE_NAME, ADMIN_SERVICE), limits.max_tensor_bytes + limits.max_message_bytes, tls)
    return frontends, dispatch
