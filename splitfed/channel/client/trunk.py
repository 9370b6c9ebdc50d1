"""The client side of the split channel: :class:`TrunkClient`, one client's connection to a trunk server.

Tensors cross over the socket (unary calls, or streamed chunks above the unary
threshold), or through a shared-memory region when client and trunk share a
host (:mod:`splitfed.channel.transports.shm.lane`). :class:`~splitfed.channel.client.remote.RemoteTrunk`
wraps a client as an ``nn.Module`` for autograd.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import torch

from splitfed.channel.wire import fastwire
from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.wire import split_channel_pb2_grpc as pb_grpc
from splitfed.channel.transports.bulk.lane import BulkLane
from splitfed.channel.security.bulktls import BulkTLS
from splitfed.channel.transports.grpc.lanes import Lane
from splitfed.channel.wire.limits import CLIENT_ID_KEY, MODEL_KEY, SERVICE_NAME, ChannelLimits
from splitfed.channel.transports.shm.lane import SharedLane
from splitfed.channel.transports.grpc.streams import stream_call, stream_threshold
from splitfed.channel.wire.replies import channel_error, computes_on_gpu, decoded_on, own_reply, pinned_bytes
from splitfed.channel.wire.retry import RetryPolicy
from splitfed.channel.wire.messages import (
    decode_single,
    encode,
    encode_state,
    payload_bytes,
    spec_to_proto,
)
from splitfed.codec.tensors import EncodedTensor, TensorLimits, WireDType, encode_packed, torch_dtype
from splitfed.codec.tensors import wire_dtype as to_wire_dtype
from splitfed.codec.compression import ErrorFeedback, WireCompression
from splitfed.tuning import tune_malloc
from splitfed.errors import ChannelError, ConfigError
from splitfed.split.base import CutState

log = logging.getLogger(__name__)

_OUTCOME_NAMES = {v: k for k, v in pb.UpdateOutcome.items()}
#: The outcome of a micro-batch whose step is still open (the step's outcome comes with its last part).
PART_OUTCOME = _OUTCOME_NAMES[pb.UPDATE_OUTCOME_UNSPECIFIED]


def _reply_alloc(sent: torch.Tensor, reply_spec: Any, owned: bool, on_device: bool) -> Callable[[int], Any] | None:
    """Where a streamed reply gathers: pinned memory when its caller computes on a GPU and the reply is either
    raw and ``owned`` (it is then handed over with no copy) or compressed and rebuilt on the GPU (``on_device``:
    its parts cross from there at the copy engine's speed), else numpy's."""
    pinned = (on_device and sent.is_cuda) if reply_spec.active else (owned and computes_on_gpu(sent))
    return pinned_bytes if pinned else None


T = TypeVar("T")

#: How long :meth:`TrunkClient.close` tries to leave the step group.
LEAVE_TIMEOUT_S = 5.0


@dataclass
class BackwardReply:
    """The gradient for the bottom part and what the trunk did with its own gradient."""

    grad: torch.Tensor
    outcome: str
    trunk_version: int
    staleness: int


class TrunkClient:
    """One client's connection to a trunk server.

    Args:
        address: ``host:port`` of the trunk server.
        client_id: this client's name on the server (default: a random id);
            ignored by servers that identify clients by ``token``.
        insecure: use plaintext; required unless ``credentials`` are given.
        credentials: ``grpc.ChannelCredentials`` for TLS (see :mod:`splitfed.channel.security.credentials`).
        token: bearer token sent as ``authorization`` metadata.
        wire_dtype: dtype floating activations and gradients travel in (fp32, fp16, bf16).
        limits: message sizes and the unary/stream threshold.
        retry: retry policy and overall timeout per call.
        compression: gRPC compression for every call (e.g. ``grpc.Compression.Gzip``).
        wire_compression: compression of what crosses the cut (``none``, ``int8``, ``topk`` or a
            :class:`~splitfed.codec.compression.WireCompression`): this client compresses what it sends
            (error feedback on its gradients) and asks the server to compress its replies alike.
        cut: this client's cut ``(a, b)`` when clients of the run have cuts of their own: every Forward
            asks the trunk to run only blocks ``[a, b)`` (None: the trunk's whole range).
        channels: gRPC channels (TCP connections) that tensor-carrying calls take in turn; more than
            one lets calls in flight at once (micro-batches, :meth:`submit`) serialise on several
            cores of the server and the network stack.
        max_in_flight: calls :meth:`submit` runs at once.
        shared_memory: ``auto`` (default): when the server's address is loopback, large tensors cross the
            cut through a shared-memory region the server creates for this client, falling back to the
            socket when it cannot be mapped; ``on``: try whatever the address; ``off``: always the socket
            (see :mod:`splitfed.channel.transports.shm.regions`).
        shared_memory_bytes: size of that region.
        model: the model this client's calls are for, on a server that holds several (sent as
            ``x-splitfed-model`` metadata; empty: none is sent, and a server holding one model serves it).
        bulk_connections: ask the server for a bulk link of this many TCP connections, over which streamed
            calls send and receive their tensor bytes instead of gRPC chunks (:mod:`splitfed.channel.transports.bulk.links`; 0:
            none). Where the server offers none, calls stream over gRPC.
        bulk_tls: a TLS client's bulk links (:class:`~splitfed.channel.security.bulktls.BulkTLS`: the same trust root as
            ``credentials``, ``BulkTLS.client(ca_pem)``); required with ``credentials`` and ``bulk_connections``.
        direct_calls: send the calls whose tensors go through a shared-memory region straight to the server's
            engine over its Unix socket when it offers one (:mod:`splitfed.channel.transports.direct.server`), else over gRPC.
    """

    def __init__(self, address: str, *, client_id: str | None = None, insecure: bool = False,
                 credentials: grpc.ChannelCredentials | None = None, token: str | None = None,
                 wire_dtype: str | WireDType = "fp32", limits: ChannelLimits = ChannelLimits(),
                 retry: RetryPolicy = RetryPolicy(), compression: grpc.Compression | None = None,
                 options: Sequence[tuple[str, Any]] = (),
                 wire_compression: WireCompression | str | None = None,
                 cut: tuple[int, int] | None = None, channels: int = 1, max_in_flight: int = 4,
                 shared_memory: str = "auto", shared_memory_bytes: int = 64 << 20, model: str = "",
                 bulk_connections: int = 0, bulk_tls: BulkTLS | None = None, direct_calls: bool = True) -> None:
        tune_malloc()
        self.cut = (0, 0) if cut is None else (int(cut[0]), int(cut[1]))
        if credentials is None and not insecure:
            raise ConfigError("the trunk client needs TLS credentials, or insecure=True for plaintext")
        if bulk_connections and (credentials is None) != (bulk_tls is None):
            raise ConfigError("a bulk link is TLS exactly when the channel is: pass bulk_tls=BulkTLS.client(ca_pem) "
                              "(the CA the channel's credentials trust) with TLS credentials, and neither for "
                              "plaintext" if credentials is not None else
                              "bulk_tls is for a TLS channel: pass its credentials too, or drop bulk_tls")
        #: TLS for the bulk link (None: plaintext, as the channel).
        self.bulk_tls = bulk_tls
        self.address = address
        self.client_id = client_id or uuid.uuid4().hex[:12]
        self.wire_dtype = to_wire_dtype(wire_dtype)
        self.limits = limits
        self.retry = retry
        self.compression = compression
        self.wire_compression = WireCompression.of(wire_compression)
        #: Error-feedback residuals of the gradients this client sends.
        self.feedback = ErrorFeedback()
        # The server checks what it receives for NaN/Inf; the client checks its loss instead
        # (see splitfed.client.training), which catches a bad trunk output without another pass.
        self.tensor_limits = TensorLimits(max_bytes=limits.max_tensor_bytes, require_finite=False)
        opts: list[tuple[str, Any]] = limits.grpc_options() + [
            ("grpc.enable_retries", 1),
            ("grpc.service_config", retry.service_config()),
            ("grpc.per_rpc_retry_buffer_size", 2 * limits.max_message_bytes),
            *options,
        ]
        if channels < 1 or max_in_flight < 1:
            raise ConfigError("channels and max_in_flight must be >= 1")
        # Several channels must not share one connection: a local subchannel pool each.
        self._channels = [grpc.secure_channel(address, credentials, options=o) if credentials is not None
                          else grpc.insecure_channel(address, options=o)
                          for o in ([opts] + [opts + [("grpc.use_local_subchannel_pool", 1)]] * (channels - 1))]
        self._channel = self._channels[0]
        self._stub = pb_grpc.SplitChannelStub(self._channel)
        self._lanes = [Lane.of(channel) for channel in self._channels]
        self._turn = itertools.count()
        self.max_in_flight = max_in_flight
        self._pool: ThreadPoolExecutor | None = None
        self.model = model
        self._metadata: list[tuple[str, str]] = [(CLIENT_ID_KEY, self.client_id)]
        if model:
            self._metadata.append((MODEL_KEY, model))
        if token is not None:
            self._metadata.append(("authorization", f"Bearer {token}"))
        self._reply_needs_stream = False
        self._lock = threading.Lock()
        #: Payload bytes of the tensors sent and received (over the socket or shared memory).
        self.bytes_sent = 0
        self.bytes_received = 0
        self.calls = 0
        self.shared = SharedLane(self, shared_memory, shared_memory_bytes, direct_calls)
        self.bulk = BulkLane(self, bulk_connections)
        #: Whether this client may be in the trunk's step group (it joined, or sent a training forward, which
        #: joins); :meth:`close` then leaves, so a sync step never waits for a client that is done.
        self.member = False

    # -- plumbing ------------------------------------------------------------------
    def set_token(self, token: str | None) -> None:
        """Replace the bearer token sent with every call (a direct-call ticket, issued for the old one, is
        dropped: the region's calls go over gRPC with the new token)."""
        self._metadata = [(k, v) for k, v in self._metadata if k != "authorization"]
        if token is not None:
            self._metadata.append(("authorization", f"Bearer {token}"))
        self.shared.forget_direct()

    def _invoke(self, name: str, fn: Callable[..., Any], request: Any, extra: Sequence[tuple[str, str]] = ()) -> Any:
        try:
            return fn(request, timeout=self.retry.timeout_s, metadata=self._metadata + list(extra),
                      compression=self.compression)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            details = exc.details() if hasattr(exc, "details") else str(exc)
            raise channel_error(name, self.address, code, details) from None

    def _unary(self, name: str, fn: Callable[..., Any], request: fastwire.Parsed, cuda: bool) -> fastwire.Parsed:
        """A unary Forward or Backward with its tensors inline: over the direct-call link of this client's
        shared-memory region where it has or can open one (:meth:`SharedLane.inline`; ``cuda``: its tensor came from
        a GPU), else over gRPC."""
        reply = self.shared.inline(name, request, cuda)
        return reply if reply is not None else self._invoke(name, fn, request)

    def _account(self, sent: int, received: int) -> None:
        with self._lock:
            self.bytes_sent += sent
            self.bytes_received += received
            self.calls += 1

    def _stream_threshold(self) -> int:
        return stream_threshold(self)

    def _stream_call(self, name: str, fn: Callable[..., Iterator[pb.Frame]], header: pb.Frame, field: str,
                     encs: list[EncodedTensor], reply_field: str, extra: Sequence[tuple[str, str]] = (),
                     alloc: Callable[[int], Any] | None = None) -> Any:
        return stream_call(self, name, fn, header, field, encs, reply_field, extra, alloc)

    def raw_unary(self, method: str) -> Callable[[bytes], bytes]:
        """A caller of ``method`` of the split channel's service that sends and returns raw bytes, with this
        client's channel, retry policy, deadline and metadata (what :mod:`bench.core` measures gRPC's own
        per-call cost with). Errors raise :class:`~splitfed.errors.ChannelError`."""
        fn = self._channel.unary_unary(f"/{SERVICE_NAME}/{method}")
        return lambda payload: self._invoke(method, fn, payload)

    # -- RPCs ----------------------------------------------------------------------
    def info(self) -> pb.InfoReply:
        """The served model's name, cuts, trunk mode and version, and the server's limits."""
        return self._invoke("Info", self._stub.Info, pb.InfoRequest())

    def join(self) -> int:
        """Enter the trunk's step group; returns the group size."""
        self.member = True
        return self._invoke("Join", self._stub.Join, pb.JoinRequest()).group_size

    def leave(self) -> int:
        """Leave the trunk's step group; returns the group size."""
        size = self._invoke("Leave", self._stub.Leave, pb.LeaveRequest()).group_size
        self.member = False
        return size

    def forward(self, state: CutState, *, activation_id: str | None = None, train: bool = True,
                num_examples: int | None = None, session_id: str = "", owned: bool = False,
                on_device: bool = False) -> tuple[torch.Tensor, int]:
        """Send a cut state; returns the trunk's output hidden state and the trunk version it saw.

        The output is in host memory; it may view the reply's read-only bytes unless ``owned`` (then it is
        memory of its own, pinned when ``state`` is on a GPU).
        ``on_device``: the output may stay on ``state``'s GPU: when a shared-memory region with CUDA events
        carries it (no host waits for the GPU), or when it comes compressed (it is rebuilt on the GPU).
        """
        activation_id = activation_id or os.urandom(16).hex()
        if train and not session_id:
            self.member = True  # a training forward joins the step group
        act = self.wire_compression.activations
        n = int(num_examples if num_examples is not None else state.hidden.shape[0])
        req = pb.ForwardRequest(activation_id=activation_id, train=train, reply_dtype=int(self.wire_dtype),
                                num_examples=n, session_id=session_id, reply_compression=spec_to_proto(act),
                                cut_start=self.cut[0], cut_end=self.cut[1])
        lane = self._lane()
        if not act.active and (shared := self.shared.forward(lane, req, state, on_device)) is not None:
            return shared[1], shared[0].trunk_version
        encs = encode_state(state, self.wire_dtype, act)
        sent = payload_bytes(encs)
        if sent <= self._stream_threshold() and not self._reply_needs_stream:
            try:
                parsed = self._unary("Forward", lane.forward, fastwire.Parsed(req, encs), state.hidden.is_cuda)
                reply, out = parsed.header, parsed.tensors
            except ChannelError as exc:
                if exc.code != "RESOURCE_EXHAUSTED" or "use ForwardStream" not in str(exc):
                    raise
                self._reply_needs_stream = True  # the trunk's output outgrows its input
                return self.forward(state, activation_id=activation_id, train=train, num_examples=n,
                                    session_id=session_id, owned=owned)
        else:
            asm = self._stream_call("ForwardStream", lane.forward_stream, pb.Frame(forward_request=req),
                                    "forward_request", encs, "forward_reply",
                                    alloc=_reply_alloc(state.hidden, act, owned, on_device))
            reply, out = asm.header, asm.tensors
        self._account(sent, payload_bytes(out))
        if on_device and (hidden := decoded_on(out, "hidden", self.tensor_limits, state.hidden.device)) is not None:
            return hidden, reply.trunk_version
        hidden = decode_single(out, "hidden", self.tensor_limits)
        return (own_reply(hidden, out[0], computes_on_gpu(state.hidden)) if owned else hidden), reply.trunk_version

    def backward(self, activation_id: str, grad: torch.Tensor, *, input_numel: int | None = None,
                 step_id: str = "", step_parts: int = 0, feedback_key: str = "grad",
                 owned: bool = False, on_device: bool = False) -> BackwardReply:
        """Send the gradient of the loss w.r.t. a forward's output; returns the gradient w.r.t. its input.

        ``input_numel`` (elements of the forward's input) sizes the reply: the
        transport is chosen from the larger of the request and the reply, so a
        trunk whose input is larger than its output never gets a reply too large
        for a unary call.

        With gradient compression, the gradient travels compressed with this
        client's error-feedback residual added; the residual it leaves is kept
        once the call succeeded (``feedback_key``: whose residual, e.g. one per micro-batch).

        ``step_id``/``step_parts``: this gradient is one of the ``step_parts``
        micro-batches of one client step, which the trunk takes as one
        contribution; the reply of a part that does not complete the step comes
        at once, with outcome ``UPDATE_OUTCOME_UNSPECIFIED``. ``owned``, ``on_device``: as for :meth:`forward`.
        """
        spec, token = self.wire_compression.gradients, None
        req = pb.BackwardRequest(activation_id=activation_id, reply_dtype=int(self.wire_dtype),
                                 reply_compression=spec_to_proto(spec), step_id=step_id, step_parts=step_parts)
        if not spec.active and (shared := self.shared.backward(self._lane(), req, grad, input_numel,
                                                               on_device)) is not None:
            reply, grad_in = shared
            return BackwardReply(grad_in, _OUTCOME_NAMES.get(reply.outcome, "UNKNOWN"), reply.trunk_version,
                                 reply.staleness)
        if spec.active and grad.is_floating_point():
            packed, token = self.feedback.compress(feedback_key, grad, spec, torch_dtype(self.wire_dtype))
            encs = [encode_packed("grad", packed)]
        else:
            encs = [encode("grad", grad, self.wire_dtype)]
        sent, lane = payload_bytes(encs), self._lane()
        reply_bytes = 0 if input_numel is None else input_numel * torch_dtype(self.wire_dtype).itemsize
        if max(sent, reply_bytes) <= self._stream_threshold():
            parsed = self._unary("Backward", lane.backward, fastwire.Parsed(req, encs), grad.is_cuda)
            reply, out = parsed.header, parsed.tensors
        else:
            asm = self._stream_call("BackwardStream", lane.backward_stream, pb.Frame(backward_request=req),
                                    "backward_request", encs, "backward_reply",
                                    alloc=_reply_alloc(grad, spec, owned, on_device))
            reply, out = asm.header, asm.tensors
        grad_in = decoded_on(out, "grad", self.tensor_limits, grad.device) if on_device else None
        if grad_in is None:
            grad_in = decode_single(out, "grad", self.tensor_limits)
            if owned:
                grad_in = own_reply(grad_in, out[0], computes_on_gpu(grad))
        if token is not None:
            self.feedback.commit(token)
        self._account(sent, payload_bytes(out))
        return BackwardReply(grad_in, _OUTCOME_NAMES.get(reply.outcome, "UNKNOWN"), reply.trunk_version,
                             reply.staleness)

    def open_session(self, max_length: int, batch_size: int = 1) -> tuple[str, float]:
        """Open an inference session (server-side KV cache); returns its id and idle TTL."""
        reply = self._invoke("OpenSession", self._stub.OpenSession,
                             pb.OpenSessionRequest(max_length=max_length, batch_size=batch_size))
        return reply.session_id, reply.idle_ttl_s

    def close_session(self, session_id: str) -> None:
        """Close an inference session and free its cache."""
        self._invoke("CloseSession", self._stub.CloseSession, pb.CloseSessionRequest(session_id=session_id))

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until the channel connects, or raise :class:`ChannelError`."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise ChannelError(f"trunk server {self.address} not reachable within {timeout}s; is it running "
                               "and is the address right?", code="UNAVAILABLE") from None

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` (e.g. :meth:`forward`) on this client's call threads; at most
        ``max_in_flight`` at once. Retries happen inside each call, as for a direct one."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_in_flight, thread_name_prefix="splitfed-call")
            pool = self._pool
        return pool.submit(fn, *args, **kwargs)

    def _lane(self) -> Lane:
        return self._lanes[next(self._turn) % len(self._lanes)]

    def close(self) -> None:
        """Leave the trunk's step group (when this client trained), then close the gRPC channels, the call
        threads and the shared-memory region. A server that is gone costs at most a few seconds here."""
        if self.member:
            try:
                self._stub.Leave(pb.LeaveRequest(), timeout=min(self.retry.timeout_s, LEAVE_TIMEOUT_S),
                                 metadata=self._metadata)
                self.member = False
            except grpc.RpcError as exc:  # the server drops a silent member after its trunk-timeout anyway
                log.debug("leaving the step group of %s on close failed: %s", self.address, exc.code())
        self.shared.close()
        self.bulk.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> TrunkClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["PART_OUTCOME", "BackwardReply", "RetryPolicy", "TrunkClient"]
