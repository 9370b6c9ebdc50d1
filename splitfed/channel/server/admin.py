"""The model admin service (``splitfed.admin.v1.ModelAdmin``): list, load, unload and reload a server's models.

It shares the server's port and TLS but has a token of its own, never a client's:
every call must carry ``authorization: Bearer <admin token>``. A call without it
gets UNAUTHENTICATED, one with another token (a client's, a guess) PERMISSION_DENIED,
and on a server started without an admin token every call gets PERMISSION_DENIED
(the service is off). Tokens are compared in constant time. A request whose bytes
do not parse gets INVALID_ARGUMENT. The work is the registry's
(:mod:`splitfed.channel.server.registry`); this module checks, converts and maps errors to
precise statuses.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from splitfed.channel.admin import model_admin_pb2 as pb
from splitfed.channel.admin.specs import spec_from_proto, spec_to_proto
from splitfed.channel.server.handlers import _safe, check_parsed, metadata
from splitfed.channel.server.registry import Entry, ModelRegistry
from splitfed.channel.server.units import ModelState
from splitfed.errors import (
    AuthError,
    CodecError,
    ConfigError,
    MissingExtraError,
    ModelBusyError,
    ModelExistsError,
    ModelLoadError,
    ModelNotHeldError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SplitError,
    SplitFedError,
    UnsupportedModelError,
)

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["ModelAdmin"].full_name
MIN_TOKEN_LENGTH = 16
T = TypeVar("T")

_STATUS: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (AuthError, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (ModelExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (ModelNotHeldError, grpc.StatusCode.NOT_FOUND),
    (ModelLoadError, grpc.StatusCode.NOT_FOUND),
    (ModelBusyError, grpc.StatusCode.FAILED_PRECONDITION),
    (MissingExtraError, grpc.StatusCode.FAILED_PRECONDITION),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (SplitError, grpc.StatusCode.INVALID_ARGUMENT),
    (UnsupportedModelError, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (CodecError, grpc.StatusCode.INVALID_ARGUMENT),
]
_STATES = {ModelState.LOADING: pb.LOADING, ModelState.READY: pb.READY, ModelState.UNLOADING: pb.UNLOADING,
           ModelState.FAILED: pb.FAILED}


def check_admin_token(token: str | None) -> str | None:
    """``token`` if it may guard the admin service (at least 16 characters, no spaces), else ConfigError."""
    if token is None:
        return None
    token = token.strip()
    if len(token) < MIN_TOKEN_LENGTH or any(c.isspace() for c in token) or not token.isprintable():
        raise ConfigError(f"the admin token must be at least {MIN_TOKEN_LENGTH} printable characters without "
                          "spaces; make one with `python -c 'import secrets; print(secrets.token_urlsafe(32))'`")
    return token


def status_of(entry: Entry) -> pb.ModelStatus:
    """What ``list`` tells about one model."""
    out = pb.ModelStatus(name=entry.name, state=_STATES[entry.state], error=entry.error)
    spec, unit = entry.spec, entry.unit
    if spec is not None:
        out.model, out.lora_rank, out.device = spec.model, spec.lora_rank, spec.device
        out.trunk_mode = spec.trunk_mode
        if spec.cuts is not None:
            out.cuts.extend(spec.cuts)
    if entry.estimate is not None:
        out.estimated_bytes = entry.estimate.total
    if unit is not None:
        out.trunk_mode = unit.trunk_mode
        out.device = str(unit.runtime.device)
        out.cuts[:] = list(unit.cuts or ())
        out.trunk_version = unit.runtime.version
        out.calls_in_flight = unit.in_flight
        out.bytes.extend(pb.DeviceBytes(device=d, bytes=n) for d, n in sorted(unit.held_bytes().items()))
    elif entry.estimate is not None:
        out.bytes.append(pb.DeviceBytes(device=entry.estimate.device, bytes=entry.estimate.total))
    return out


class AdminServicer:
    """The admin RPCs over a :class:`ModelRegistry`, behind the admin token.

    Args:
        registry: the server's models.
        token: the admin token (None: the service is off and refuses every call).
    """

    def __init__(self, registry: ModelRegistry, token: str | None) -> None:
        self.registry = registry
        self._token = check_admin_token(token)

    def _authorize(self, context: Any) -> None:
        if self._token is None:
            raise PermissionDeniedError("the admin service is off on this server: start it with --admin-token-file "
                                        "(a token of its own, never a client's)")
        auth = metadata(context).get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise AuthError("admin calls need the admin token as 'authorization: Bearer <token>' "
                            "(splitfed models ... --admin-token-file F)")
        if not hmac.compare_digest(token.strip().encode(), self._token.encode()):
            raise PermissionDeniedError("the admin token is wrong (a client's token is not an admin token); use "
                                        "the token the server was started with")

    async def _call(self, context: Any, request: Any, fn: Callable[[], Awaitable[T]]) -> T:
        try:
            self._authorize(context)  # before anything in the request is looked at
            check_parsed(request)
            return await fn()
        except SplitFedError as exc:
            code = next((c for kind, c in _STATUS if isinstance(exc, kind)), grpc.StatusCode.INTERNAL)
            (log.error if code is grpc.StatusCode.INTERNAL else log.warning)("admin: %s: %s", code.name, exc)
            await context.abort(code, str(exc))
        except Exception as exc:  # a load that failed in the model's own code: say what and where
            log.exception("admin call failed")
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{type(exc).__name__}: {exc}")
        raise AssertionError("unreachable")  # pragma: no cover

    async def List(self, request: pb.ListRequest, context: Any) -> pb.ListReply:
        async def run() -> pb.ListReply:
            entries = [self.registry.entries[n] for n in self.registry.names()]
            return pb.ListReply(models=[status_of(e) for e in entries], budget=self.registry.budget.limits)
        return await self._call(context, request, run)

    async def Load(self, request: pb.LoadRequest, context: Any) -> pb.LoadReply:
        async def run() -> pb.LoadReply:
            spec = spec_from_proto(request.spec)
            log.info("admin: load %s (%s)", spec.name, spec.model)
            entry = await self.registry.load(spec, wait=request.wait)
            return pb.LoadReply(model=status_of(entry))
        return await self._call(context, request, run)

    async def Unload(self, request: pb.UnloadRequest, context: Any) -> pb.UnloadReply:
        async def run() -> pb.UnloadReply:
            drain = request.drain_timeout_s if request.HasField("drain_timeout_s") else 30.0
            log.info("admin: unload %s", request.name)
            entry = await self.registry.unload(request.name, drain_timeout_s=drain)
            return pb.UnloadReply(model=status_of(entry))
        return await self._call(context, request, run)

    async def Reload(self, request: pb.ReloadRequest, context: Any) -> pb.ReloadReply:
        async def run() -> pb.ReloadReply:
            spec = spec_from_proto(request.spec) if request.HasField("spec") else None
            drain = request.drain_timeout_s if request.HasField("drain_timeout_s") else 30.0
            log.info("admin: reload %s", request.name)
            entry = await self.registry.reload(request.name, spec, wait=request.wait, drain_timeout_s=drain)
            return pb.ReloadReply(model=status_of(entry))
        return await self._call(context, request, run)


def admin_handlers(servicer: AdminServicer) -> grpc.GenericRpcHandler:
    """The service's handlers; bytes that do not parse become INVALID_ARGUMENT (not INTERNAL)."""
    handlers = {}
    for name, request, reply in (("List", pb.ListRequest, pb.ListReply), ("Load", pb.LoadRequest, pb.LoadReply),
                                 ("Unload", pb.UnloadRequest, pb.UnloadReply),
                                 ("Reload", pb.ReloadRequest, pb.ReloadReply)):
        handlers[name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name), request_deserializer=_safe(request.FromString, request.__name__),
            response_serializer=reply.SerializeToString)
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


__all__ = ["SERVICE", "AdminServicer", "admin_handlers", "check_admin_token", "spec_from_proto",
           "spec_to_proto", "status_of"]
