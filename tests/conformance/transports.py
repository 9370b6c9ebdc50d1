"""The transports the conformance suite runs over: one :class:`Transport` adapter each, listed in ``TRANSPORTS``.

An adapter knows the server's and the client's settings that make a call take its way across the cut, how to tell
that a call did (``went``), and how to send a request exactly as given, malformed or not (``send``): inline in a
unary gRPC message, as a stream header whose bytes go over a bulk link, or in a shared-memory region slice named by
a call over gRPC or over the engine's direct-call socket. A transport added later gets every conformance test by
adding one line to ``TRANSPORTS``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch
from conftest import tiny_model
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitfed.channel.client.trunk import TrunkClient
from splitfed.channel.server.trunkserver import TrunkServer
from splitfed.channel.transports.shm.slices import ClientRegion, Slice
from splitfed.channel.wire import fastwire
from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.wire.limits import SERVICE_NAME, ChannelLimits
from splitfed.codec.tensors import EncodedTensor, RegionRef, encode
from splitfed.split import split_model

#: Rows, tokens and width of the cut's hidden state (the tiny Llama of tests/conftest.py, blocks [1, 3) served).
ROWS, TOKENS, HIDDEN = 2, 5, 32
CUTS = (1, 3)
#: Small limits, so that the oversized request is small too (a 256 KiB tensor is refused on every transport).
LIMITS = ChannelLimits(max_message_bytes=1 << 20, stream_threshold_bytes=512 << 10, chunk_bytes=64 << 10,
                       max_tensor_bytes=128 << 10)
#: Below this the bulk transport's calls stay unary (its cut tensors, 1,280 bytes, stream over the link).
BULK_LIMITS = ChannelLimits(max_message_bytes=1 << 20, stream_threshold_bytes=256, chunk_bytes=64 << 10,
                            max_tensor_bytes=128 << 10)
#: The call's reply slice in a region (the region transports' raw sends offer one, as the client library does).
REPLY_SLICE_BYTES = 64 << 10


def model() -> torch.nn.Module:
    """The tiny Llama whose blocks [1, 3) every transport's server holds (same weights each time)."""
    return tiny_model("llama").train()


def trunk() -> torch.nn.Module:
    return split_model(model(), CUTS).trunk


@dataclass(frozen=True)
class Transport:
    """One way across the cut.

    Args:
        name: the test id.
        server: TrunkServer keyword arguments that offer it.
        client: TrunkClient keyword arguments that take it.
        went: how many calls of ``client`` took it (compared before and after a step).
        carriage: how a request's tensors travel: ``unary`` (inline in a gRPC message), ``stream`` (a stream
            header, bytes beside it), ``region`` (a shared-memory slice); a few refusals differ by it.
        direct: region calls go over the direct-call socket rather than gRPC.
        needs: what the machine must have (``cuda``), else the transport's tests skip saying so.
        tls: what TLS covers of it, where that is less than all of it (for the suite's table).
        retry_leaves: a call whose reply was lost is retried another way (why; empty: over the transport again).
    """

    name: str
    server: dict[str, Any] = field(default_factory=dict)
    client: dict[str, Any] = field(default_factory=dict)
    went: Callable[[TrunkServer, TrunkClient], int] = lambda s, c: 0
    carriage: str = "unary"
    direct: bool = False
    needs: str = ""
    tls: str = ""
    retry_leaves: str = ""

    def missing(self) -> str:
        """Why this machine cannot run the transport ('' when it can)."""
        if self.needs == "cuda" and not torch.cuda.is_available():
            return "CUDA IPC needs a GPU (client and trunk on one CUDA device); none here"
        return ""

    @property
    def device(self) -> str:
        return "cuda" if self.needs == "cuda" else "cpu"

    def open_server(self, module: torch.nn.Module | None = None, **kwargs: Any) -> TrunkServer:
        """A server of this transport on loopback (plaintext unless ``credentials`` are given)."""
        settings = {"insecure": "credentials" not in kwargs, "lr": 0.05, "limits": LIMITS, **self.server, **kwargs}
        trunk_module = module if module is not None else trunk()
        return TrunkServer(trunk_module.to(self.device), **settings).start()

    def open_client(self, server: TrunkServer, **kwargs: Any) -> TrunkClient:
        settings = {"insecure": "credentials" not in kwargs, "limits": LIMITS, **self.client, **kwargs}
        return TrunkClient(server.address, **settings)

    # -- raw requests ---------------------------------------------------------------------------------
    def send(self, client: TrunkClient, method: str, header: Any, encs: list[EncodedTensor]) -> fastwire.Parsed:
        """``method`` (Forward or Backward) with ``header`` and ``encs`` exactly as given, this transport's way;
        errors raise :class:`~splitfed.errors.ChannelError`."""
        lane = client._lanes[0]
        if self.carriage == "unary":
            fn = lane.forward if method == "Forward" else lane.backward
            return client._invoke(method, fn, fastwire.Parsed(header, encs))
        if self.carriage == "stream":
            kind = "forward" if method == "Forward" else "backward"
            fn = lane.forward_stream if method == "Forward" else lane.backward_stream
            asm = client._stream_call(f"{method}Stream", fn, pb.Frame(**{f"{kind}_request": header}),
                                      f"{kind}_request", encs, f"{kind}_reply")
            return fastwire.Parsed(asm.header, asm.tensors)
        region = _region(client, self.device)
        pieces = [region.take(max(len(e.data), 1)) for e in encs] + [region.take(REPLY_SLICE_BYTES)]
        assert all(p is not None for p in pieces), "the region has no room"
        try:
            sent = [_into_region(e, p) for e, p in zip(encs, pieces)]
            header.reply_region.CopyFrom(fastwire.region_slice(pieces[-1].ref))
            if self.direct:
                assert region.direct is not None, "the server offered no direct-call socket"
                return region.direct.call(method, fastwire.Parsed(header, sent), client.retry.timeout_s)
            fn = lane.forward if method == "Forward" else lane.backward
            return client._invoke(method, fn, fastwire.Parsed(header, sent))
        finally:  # answered (the reply read, or refused): the server writes no more into them
            for piece in pieces:
                region.give(piece)


def _region(client: TrunkClient, device: str) -> ClientRegion:
    region = client.shared._region(cuda=device == "cuda", need=REPLY_SLICE_BYTES)
    assert region is not None, "the server offered no shared-memory region"
    return region


def _into_region(enc: EncodedTensor, piece: Slice) -> EncodedTensor:
    """``enc``'s bytes written into ``piece`` of a region; its message names the slice (dtype and shape kept as
    declared, however wrong; an empty tensor names none)."""
    data = bytes(enc.data)
    if data:
        piece.region.mapping.view(piece.offset, len(data)).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return EncodedTensor(enc.name, enc.dtype, enc.shape, b"", enc.compressed,
                         RegionRef(piece.region.name, piece.offset, len(data)) if data else None)


def _shm_went(s: TrunkServer, c: TrunkClient) -> int:
    return c.shared.calls - c.shared.direct_calls


#: Every transport under test. Add one line here and the transport gets every conformance test.
TRANSPORTS: list[Transport] = [
    Transport("grpc", {"direct_calls": False}, {"shared_memory": "off"},
              lambda s, c: c.calls - c.shared.calls - c.bulk.calls),
    Transport("shm", {"direct_calls": False}, {"direct_calls": False}, _shm_went, carriage="region"),
    Transport("bulk", {"bulk_connections": 2, "direct_calls": False, "limits": BULK_LIMITS},
              {"shared_memory": "off", "bulk_connections": 2, "limits": BULK_LIMITS},
              lambda s, c: c.bulk.calls, carriage="stream",
              retry_leaves="a bulk call that fails UNAVAILABLE gives its link up and is retried over gRPC chunks (by "
                           "design: the link may be what failed)"),
    Transport("direct", {}, {}, lambda s, c: c.shared.direct_calls, carriage="region", direct=True,
              tls="the Unix socket itself carries no TLS (loopback-only by design, in a directory only the server's "
                  "user may enter); the ticket that admits a client comes over the TLS channel"),
    Transport("frontend", {"frontends": 1, "direct_calls": False}, {"shared_memory": "off"},
              lambda s, c: s.frontends.listener.step_calls[c.client_id],
              tls="the front-end process holds the TLS channel; its link to the engine is a Unix socket on the host"),
    Transport("cuda-ipc", {"direct_calls": False}, {"direct_calls": False}, lambda s, c: c.shared.ordered,
              carriage="region", needs="cuda"),
]


def by_name(name: str) -> Transport:
    return next(t for t in TRANSPORTS if t.name == name)


# -- helpers the tests share -------------------------------------------------------------------------------
def tensor(name: str, t: torch.Tensor, **override: Any) -> EncodedTensor:
    """``t`` as it travels, with fields overridden (``dtype`` may be any int, ``shape`` any tuple)."""
    enc = encode(name, t.cpu())
    fields = {"name": enc.name, "dtype": enc.dtype, "shape": enc.shape, "data": bytes(enc.data), **override}
    return EncodedTensor(fields["name"], fields["dtype"], tuple(fields["shape"]), fields["data"])


def hidden(rows: int = ROWS, tokens: int = TOKENS, width: int = HIDDEN) -> torch.Tensor:
    return torch.randn(rows, tokens, width)


def serving(server: TrunkServer) -> bool:
    """Whether the server's health service says SERVING."""
    with grpc.insecure_channel(server.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def snapshot(server: TrunkServer) -> tuple[dict[str, torch.Tensor], int]:
    """The trunk's weights and version."""
    rt = server.runtime
    return copy.deepcopy(rt.trunk.state_dict()), rt.version


def unchanged(server: TrunkServer, snap: tuple[dict[str, torch.Tensor], int]) -> bool:
    weights, version = snap
    now = server.runtime.trunk.state_dict()
    return server.runtime.version == version and all(torch.equal(weights[k], now[k]) for k in weights)


__all__ = ["BULK_LIMITS", "CUTS", "HIDDEN", "LIMITS", "ROWS", "TOKENS", "TRANSPORTS", "Transport", "by_name", "hidden",
           "model", "serving", "snapshot", "tensor", "trunk", "unchanged"]
