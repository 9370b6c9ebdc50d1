"""The client of the model admin service: :class:`AdminClient` (what ``splitfed models`` uses).

The admin token travels in call metadata, so the channel must be TLS unless the
server is on this machine: plaintext is refused for a non-loopback address.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from splitfed.channel.admin import model_admin_pb2 as pb
from splitfed.channel.admin import model_admin_pb2_grpc as pb_grpc
from splitfed.channel.admin.specs import spec_to_proto
from splitfed.channel.security.hosts import host_of, is_loopback
from splitfed.channel.wire.unreachable import unavailable_hint
from splitfed.errors import ChannelError, ConfigError
from splitfed.serving.spec import ModelSpec

_STATE_NAMES = {v: k for k, v in pb.ModelState.items()}


def status_dict(status: pb.ModelStatus) -> dict[str, Any]:
    """A model's status as plain data (for printing and JSON)."""
    return {"name": status.name, "state": _STATE_NAMES.get(status.state, "UNKNOWN"), "model": status.model,
            "cuts": list(status.cuts), "trunk_mode": status.trunk_mode, "lora_rank": status.lora_rank,
            "device": status.device, "bytes": {b.device: b.bytes for b in status.bytes},
            "estimated_bytes": status.estimated_bytes, "trunk_version": status.trunk_version,
            "calls_in_flight": status.calls_in_flight, "error": status.error}


class AdminClient:
    """Calls a trunk server's model admin service.

    Args:
        address: ``host:port`` of the trunk server.
        token: the server's admin token.
        credentials: ``grpc.ChannelCredentials`` for TLS (see :mod:`splitfed.channel.security.credentials`).
        insecure: plaintext; only to a loopback address (the token would cross the network in the clear).
        timeout_s: deadline of each call (a waited-for load can take minutes).
    """

    def __init__(self, address: str, token: str, *, credentials: grpc.ChannelCredentials | None = None,
                 insecure: bool = False, timeout_s: float = 900.0) -> None:
        if credentials is None:
            if not insecure:
                raise ConfigError("the admin client needs TLS credentials, or insecure=True for a server on this "
                                  "machine")
            if not is_loopback(host_of(address)):
                raise ConfigError(f"{address} is not a loopback address: the admin token would cross the network in "
                                  "the clear; connect with TLS (--tls-ca)")
        self.address = address
        self.timeout_s = timeout_s
        self._metadata = [("authorization", f"Bearer {token}")]
        self._channel = grpc.secure_channel(address, credentials) if credentials is not None else \
            grpc.insecure_channel(address)
        self._stub = pb_grpc.ModelAdminStub(self._channel)

    def _invoke(self, name: str, fn: Callable[..., Any], request: Any) -> Any:
        try:
            return fn(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            details = exc.details() if hasattr(exc, "details") else str(exc)
            hint = unavailable_hint(self.address, details, admin=True) if code == grpc.StatusCode.UNAVAILABLE else ""
            raise ChannelError(f"{name} on the admin service of {self.address} failed with {code.name}: {details}"
                               f"{hint}", code=code.name) from None

    def list(self) -> pb.ListReply:
        """Every model the server holds, with its state, cuts, trunk mode and bytes per device; and the budget."""
        return self._invoke("List", self._stub.List, pb.ListRequest())

    def load(self, spec: ModelSpec, *, wait: bool = True) -> pb.ModelStatus:
        """Load a model; with ``wait``, returns once it is READY (or raises why its load failed)."""
        return self._invoke("Load", self._stub.Load, pb.LoadRequest(spec=spec_to_proto(spec), wait=wait)).model

    def unload(self, name: str, *, drain_timeout_s: float | None = None) -> pb.ModelStatus:
        """Unload a model: its calls in flight finish (up to ``drain_timeout_s``), new ones are refused."""
        request = pb.UnloadRequest(name=name)
        if drain_timeout_s is not None:
            request.drain_timeout_s = drain_timeout_s
        return self._invoke("Unload", self._stub.Unload, request).model

    def reload(self, name: str, spec: ModelSpec | None = None, *, wait: bool = True,
               drain_timeout_s: float | None = None) -> pb.ModelStatus:
        """Unload a model and load it again (from ``spec``, or as it was loaded): fresh weights from its source."""
        request = pb.ReloadRequest(name=name, wait=wait)
        if spec is not None:
            request.spec.CopyFrom(spec_to_proto(spec))
        if drain_timeout_s is not None:
            request.drain_timeout_s = drain_timeout_s
        return self._invoke("Reload", self._stub.Reload, request).model

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
