"""gRPC health of a server of several models: each model is a service of its own, SERVING once loaded.

The split channel's service (``SERVICE_NAME``) is SERVING while any model is
READY; model ``m`` is ``SERVICE_NAME/m``, SERVICE_UNKNOWN once unloaded.
"""

from __future__ import annotations

from typing import Any

from grpc_health.v1 import health_pb2

from splitfed.channel.wire.limits import SERVICE_NAME
from splitfed.channel.server.registry import ModelRegistry
from splitfed.channel.server.units import ModelState

__all__ = ["health_name", "report_models", "report_state"]

_HEALTH = health_pb2.HealthCheckResponse


def health_name(model: str) -> str:
    """The health-checking service name of one model."""
    return f"{SERVICE_NAME}/{model}"


async def report_state(health: Any, registry: ModelRegistry, name: str, state: ModelState | None) -> None:
    """Model ``name`` is now in ``state`` (None: unloaded): set its status, and the service's."""
    if name:
        status = _HEALTH.SERVICE_UNKNOWN if state is None else \
            _HEALTH.SERVING if state is ModelState.READY else _HEALTH.NOT_SERVING
        await health.set(health_name(name), status)
    ready = any(e.state is ModelState.READY for e in registry.entries.values())
    await health.set(SERVICE_NAME, _HEALTH.SERVING if ready else _HEALTH.NOT_SERVING)


async def report_models(health: Any, registry: ModelRegistry) -> None:
    """The server serves: the overall status SERVING, then every model's."""
    await health.set("", _HEALTH.SERVING)
    await health.set(SERVICE_NAME, _HEALTH.NOT_SERVING)
    for name, entry in list(registry.entries.items()):
        await report_state(health, registry, name, entry.state)
