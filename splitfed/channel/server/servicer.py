"""The split channel's asyncio servicer: decode, hand the work to the trunk's scheduler, await, encode.

Handlers never block: trunk work runs on the scheduler's device thread and a
handler awaits its future, so a Backward waiting for a sync step or a quorum
holds no thread. Identity (token) is checked when a call starts, before a
streamed payload is read. Every failure leaves as a precise gRPC status
(never UNKNOWN): client mistakes as INVALID_ARGUMENT, NOT_FOUND and the like,
server faults as INTERNAL, and UNAVAILABLE where a retry can succeed; a call
the client cancelled ends quietly. Nothing the runtime holds changes on a
rejected request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from splitfed.channel.wire import fastwire
from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.transports.bulk.serverio import BulkService
from splitfed.channel.server.cutio import CutIO
from splitfed.channel.server.handlers import (
    Malformed,
    check_parsed,
    metadata,
    status_for,
)
from splitfed.channel.wire.limits import CLIENT_ID_KEY, RETRY_KEYS, ChannelLimits
from splitfed.channel.engine.loop import awaiting
from splitfed.channel.transports.shm.serverio import RegionIO, RegionService
from splitfed.channel.wire.messages import (
    ReplyCompression,
    decode_single,
    decode_state,
    frames,
    payload_bytes,
    reply_spec,
)
from splitfed.codec.tensors import RegionRef, TensorLimits, WireDType, torch_dtype
from splitfed.errors import (
    CodecError,
    ResourceExhaustedError,
    SessionNotFoundError,
    SplitFedError,
)
from splitfed.split.base import input_mismatch_hint, part_range, with_client_cut
from splitfed.trunk.aggregation.modes import Outcome
from splitfed.trunk.inference.decoding import SessionStep
from splitfed.trunk.aggregation.microsteps import StepPart
from splitfed.trunk.compute.requests import ForwardRequest
from splitfed.trunk.compute.runtime import TrunkRuntime
from splitfed.trunk.scheduler import MISS, TrunkScheduler
from splitfed.trunk.timeline import TIMELINE

log = logging.getLogger(__name__)

_OUTCOME = {
    Outcome.APPLIED: pb.APPLIED,
    Outcome.DOWNWEIGHTED: pb.DOWNWEIGHTED,
    Outcome.REJECTED_STALE: pb.REJECTED_STALE,
    Outcome.REJECTED_GUARD: pb.REJECTED_GUARD,
    Outcome.NOT_TRAINED: pb.NOT_TRAINED,
    Outcome.PART: pb.UPDATE_OUTCOME_UNSPECIFIED,  # a micro-batch: its step's outcome comes with its last part
}

T = TypeVar("T")

# A forward on at most this many hidden elements may run on the event loop's thread when the trunk is idle
# (skipping two thread switches); larger ones always go to the device thread.
INLINE_MAX_ELEMENTS = 1 << 15


async def _outcome(future: concurrent.futures.Future[T]) -> T:
    """The future's result: at once when it is already done (a task run inline), else awaited on the loop."""
    if future.done():
        return future.result()
    return await _awaited(future)


def _awaited(future: concurrent.futures.Future[T]) -> asyncio.Future[T]:
    """Trunk work to await without cancelling it when the call is cancelled (its client died or gave up): the work
    and the step it belongs to go on for the other clients, and nothing resolves a cancelled future."""
    return awaiting(future)


def _device_out(ready: dict, slot: RegionRef | None) -> bool:
    """Whether a request's output may stay on the trunk's device: its tensors came there through a region, and
    an event orders the reply's copy (the host never waits)."""
    return bool(ready) and slot is not None and slot.event > 0


class SplitChannelServicer(RegionService, CutIO, BulkService):
    """Decodes, schedules trunk work, awaits it, encodes; every error becomes a precise status."""

    def __init__(self, runtime: TrunkRuntime, scheduler: TrunkScheduler, limits: ChannelLimits, *,
                 model_name: str = "", cuts: tuple[int, int] | None = None,
                 authenticate: Callable[[dict[str, str]], str] | None = None, sessions: Any = None) -> None:
        self.runtime = runtime
        self.scheduler = scheduler
        self.limits = limits
        self.tensor_limits = TensorLimits(max_bytes=limits.max_tensor_bytes)
        self.model_name = model_name
        self.cuts = cuts
        self.authenticate = authenticate
        self.sessions = sessions
        self.metrics: Any = None  # TrunkMetrics when the server exports metrics
        self.replies = ReplyCompression()  # reply compression and its error feedback per client
        self._io: RegionIO | None = None  # shared-memory regions of clients on this host (see :attr:`regions`)

    # -- helpers ---------------------------------------------------------------
    def _identity(self, context: Any) -> tuple[str, bool]:
        md = metadata(context)
        retry = any(md.get(k, "0") not in ("", "0") for k in RETRY_KEYS)
        if self.authenticate is not None:
            return self.authenticate(md), retry
        return md.get(CLIENT_ID_KEY) or context.peer(), retry

    async def _on_device(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the scheduler's device thread and await it."""
        return await _awaited(self.scheduler.call(fn))

    async def _call(self, context: Any, fn: Callable[[], Awaitable[T]], request: Any = None) -> T:
        try:
            check_parsed(request)
            return await fn()
        except SplitFedError as exc:
            code = status_for(exc)
            (log.error if code is grpc.StatusCode.INTERNAL else log.warning)("%s: %s", code.name, exc)
            await context.abort(code, str(exc))
        except (RuntimeError, ValueError, IndexError) as exc:
            # Raised by the trunk's forward for inputs that passed the codec but do not fit the model.
            message = f"the trunk could not process the input: {exc}" + input_mismatch_hint(self._trunk_range())
            log.warning("INVALID_ARGUMENT: %s", message)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        except asyncio.CancelledError:
            log.debug("call cancelled by the client")
            raise
        except Exception as exc:  # a bug: say so, keep serving
            log.exception("internal error while serving a request")
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in the trunk server: {exc!r}")
        raise AssertionError("unreachable")  # pragma: no cover

    def _trunk_range(self) -> tuple[int, int] | None:
        """The model blocks this trunk holds: the cuts it is served at, else its part's range."""
        return self.cuts or part_range(self.runtime.trunk)

    async def _turn(self, client: str) -> None:
        """Wait (holding no thread) until the aggregator lets ``client`` train (sequential mode's turns)."""
        turn = self.runtime.aggregator.turn(client)
        if turn is not None and not turn.done():
            self.scheduler.wake()  # the turn's timeout is a deadline the device thread must watch
            await awaiting(turn)

    async def _refused(self, client: str) -> None:
        runtime = self.runtime
        await self._on_device(lambda: runtime.refused(client))

    def _count(self, direction: str, encs: list) -> None:
        if self.metrics is not None:
            self.metrics.tensors(direction, encs)

    # -- the work ----------------------------------------------------------------
    async def _forward(self, identity: tuple[str, bool], req: pb.ForwardRequest, tensors: list, unary: bool
                       ) -> tuple[pb.ForwardReply, list]:
        client, retry = identity
        TIMELINE.mark("forward-in", client, train=req.train)
        if not req.activation_id:
            raise CodecError("activation_id is empty; send a unique id per forward")
        spec = reply_spec(req)
        slot = self._reply_slot(client, req)
        self._count("received", tensors)
        with TIMELINE.host("decode"):
            tensors, ready, flags, arrivals = self._resolve(client, tensors, arrive=not req.session_id)
            if flags and (not req.train or req.session_id) and self._io is not None:
                self._io.verdict(client, "", flags)  # no Backward will come: check now (the host waits for the copy)
        if not req.session_id:
            tensors = await self._arrive(tensors, "hidden", ready, arrivals)
        with TIMELINE.host("decode"):
            state = with_client_cut(decode_state(tensors, self.tensor_limits, ready), req.cut_start, req.cut_end,
                                    self._trunk_range(), session=bool(req.session_id))
        small = state.hidden.numel() <= INLINE_MAX_ELEMENTS
        sink = None
        if req.session_id:
            if self.sessions is None:
                raise SessionNotFoundError("this server does not serve inference sessions")
            sessions, runtime = self.sessions, self.runtime
            step = SessionStep(client, req.session_id, state, req.activation_id)
            if callable(getattr(sessions, "run_many", None)):  # decode steps batch within the window
                out = await _outcome(self.scheduler.batched(sessions, step, step.tokens, small=small))
            else:
                out = await _outcome(self.scheduler.now_or_queued(
                    lambda: runtime.handed(sessions.step(client, req.session_id, state, step_id=req.activation_id)),
                    small=small))
            version = self.runtime.version
        else:
            if req.train:
                await self._turn(client)
            sink = self._sink(client, slot, spec, WireDType(req.reply_dtype) if req.reply_dtype else None)
            request = ForwardRequest(client, req.activation_id, state, req.train, req.num_examples, retry,
                                     device_out=_device_out(ready, slot),
                                     arrivals=tuple(arrivals), reply=sink)
            try:
                done = self.scheduler.forward_inline(request, small=small)
                if done is MISS:
                    done = await _outcome(self.scheduler.forward(request, small=small))
                out, version = done
            except SplitFedError:  # a refused forward: the step must not wait for this client
                if req.train:
                    await self._refused(client)
                raise
        reply_dtype = WireDType(req.reply_dtype) if req.reply_dtype else None
        with TIMELINE.host("encode"):
            encs = await self._reply(client, req.activation_id, "hidden", out, reply_dtype, spec, slot,
                                     feedback=False, sink=sink)
        if unary and payload_bytes(encs) > self.limits.stream_threshold_bytes:
            if req.train and not req.session_id:
                runtime = self.runtime
                await self._on_device(lambda: runtime.forget(client, req.activation_id))
            raise ResourceExhaustedError(
                f"reply of {payload_bytes(encs)} bytes is above the unary threshold; use ForwardStream")
        if req.train and flags and not req.session_id:  # read at its Backward
            self._region_io().keep(client, req.activation_id, flags)
        self._count("sent", encs)
        TIMELINE.mark("forward-out", client)
        return pb.ForwardReply(activation_id=req.activation_id, trunk_version=version), encs

    def _reply_check(self, reply_dtype: WireDType | None, unary: bool, slot: RegionRef | None = None
                     ) -> Callable[[tuple[int, ...]], None]:
        itemsize = torch_dtype(reply_dtype).itemsize if reply_dtype else self.runtime.dtype.itemsize
        limit = self.limits.stream_threshold_bytes if unary else self.limits.max_tensor_bytes
        if slot is not None:  # a reply that fits the offered slice travels there
            limit = max(limit, min(slot.nbytes, self.limits.max_tensor_bytes))

        def check(shape: tuple[int, ...]) -> None:
            nbytes = itemsize
            for d in shape:
                nbytes *= d
            if nbytes > limit:
                raise ResourceExhaustedError(
                    f"the input gradient would be {nbytes} bytes, above the {'unary' if unary else 'stream'} limit "
                    f"of {limit}; send this backward over BackwardStream (nothing was applied)")
        return check

    async def _backward(self, identity: tuple[str, bool], req: pb.BackwardRequest, tensors: list, unary: bool
                        ) -> tuple[pb.BackwardReply, list]:
        client, retry = identity
        runtime = self.runtime
        TIMELINE.mark("backward-in", client)
        try:
            spec = reply_spec(req)
            slot = self._reply_slot(client, req)
            self._count("received", tensors)
            with TIMELINE.host("decode"):
                tensors, ready, flags, arrivals = self._resolve(client, tensors)
            tensors = await self._arrive(tensors, "grad", ready, arrivals)
            grad = decode_single(tensors, "grad", self.tensor_limits, ready)
            reply_dtype = WireDType(req.reply_dtype) if req.reply_dtype else None
            check = self._reply_check(reply_dtype, unary, slot)
            step = StepPart.of(req.step_id, req.step_parts)
            device_out = _device_out(ready, slot)
            sink = self._sink(client, slot, spec, reply_dtype)

            def start() -> Any:
                return runtime.start_backward(client, req.activation_id, grad, retry=retry, reply_check=check,
                                              step=step, device_out=device_out, arrivals=tuple(arrivals),
                                              reply=sink)
            # Joining a batch is light work: done here when the device thread is idle, without two thread hops.
            pending = self.scheduler.inline(start, small=runtime.joins_batch(req.activation_id))
            if pending is MISS:
                pending = await self._on_device(start)
        except SplitFedError:  # a refused gradient: the step must not wait for this client
            await self._refused(client)
            raise
        grad_in = await _awaited(pending.grad_in)  # a batch's backward may wait for its members
        early = None
        if not flags and spec is None:  # the reply's copy overlaps the wait for the step
            early = asyncio.ensure_future(self._reply(client, req.activation_id, "grad", grad_in, reply_dtype, spec,
                                                      slot, sink=sink))
        try:
            result = await _awaited(pending.result)  # the sync barrier or quorum: no thread held
        except BaseException:
            if early is not None:
                early.cancel()
            raise
        if self._io is not None:
            self._io.verdict(client, req.activation_id, flags)
        with TIMELINE.host("encode"):
            encs = await early if early is not None else \
                await self._reply(client, req.activation_id, "grad", grad_in, reply_dtype, spec, slot, sink=sink)
        self._count("sent", encs)
        TIMELINE.mark("backward-out", client)
        reply = pb.BackwardReply(activation_id=req.activation_id, trunk_version=result.version,
                                 outcome=_OUTCOME[result.outcome], staleness=result.staleness)
        return reply, encs

    # -- RPCs --------------------------------------------------------------------
    async def Info(self, request: pb.InfoRequest, context: Any) -> pb.InfoReply:
        from splitfed import __version__

        async def run() -> pb.InfoReply:
            return pb.InfoReply(model=self.model_name, cuts=list(self.cuts or ()),
                                trunk_mode=self.runtime.aggregator.mode, trunk_version=self.runtime.version,
                                max_message_bytes=self.limits.max_message_bytes,
                                stream_threshold_bytes=self.limits.stream_threshold_bytes,
                                auth_required=self.authenticate is not None, server_version=__version__)
        return await self._call(context, run, request)

    async def Join(self, request: pb.JoinRequest, context: Any) -> pb.JoinReply:
        async def run() -> pb.JoinReply:
            client, _ = self._identity(context)
            await self._turn(client)
            size = self.runtime.join(client)
            return pb.JoinReply(trunk_version=self.runtime.version, group_size=size)
        return await self._call(context, run, request)

    async def Leave(self, request: pb.LeaveRequest, context: Any) -> pb.LeaveReply:
        async def run() -> pb.LeaveReply:
            client, _ = self._identity(context)
            self.replies.forget(client)
            runtime = self.runtime
            return pb.LeaveReply(group_size=await self._on_device(lambda: runtime.leave(client)))
        return await self._call(context, run, request)

    async def Forward(self, request: Any, context: Any) -> fastwire.Parsed:
        async def run() -> fastwire.Parsed:
            check_parsed(request)
            identity = self._identity(context)
            return fastwire.Parsed(*await self._forward(identity, request.header, request.tensors, unary=True))
        return await self._call(context, run, request)

    async def Backward(self, request: Any, context: Any) -> fastwire.Parsed:
        async def run() -> fastwire.Parsed:
            identity = self._identity(context)
            if isinstance(request, Malformed):
                await self._refused(identity[0])
            check_parsed(request)
            return fastwire.Parsed(*await self._backward(identity, request.header, request.tensors, unary=True))
        return await self._call(context, run)

    async def _stream(self, requests: AsyncIterator[Any], context: Any, field: str, reply_field: str,
                      handler: Callable[..., Awaitable[tuple[Any, list]]]) -> AsyncIterator[Any]:
        async def run() -> list[Any]:
            identity = self._identity(context)  # before a byte of payload is read
            try:
                msg = await self._gather(requests, field, identity[0], context)
            except SplitFedError:  # a refused request: the step must not wait for this client
                await self._refused(identity[0])
                raise
            reply, encs = await handler(identity, msg.header, msg.tensors)
            header = pb.Frame(**{reply_field: reply})
            if msg.bulk is not None:
                return await self._bulk_reply(identity[0], msg.bulk, header, reply_field, encs)
            return list(frames(header, reply_field, encs, self.limits.chunk_bytes))
        for frame in await self._call(context, run):
            yield frame

    async def ForwardStream(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        async for frame in self._stream(requests, context, "forward_request", "forward_reply",
                                        lambda ident, h, t: self._forward(ident, h, t, unary=False)):
            yield frame

    async def BackwardStream(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        async for frame in self._stream(requests, context, "backward_request", "backward_reply",
                                        lambda ident, h, t: self._backward(ident, h, t, unary=False)):
            yield frame

    async def OpenSession(self, request: pb.OpenSessionRequest, context: Any) -> pb.OpenSessionReply:
        async def run() -> pb.OpenSessionReply:
            client, _ = self._identity(context)
            if self.sessions is None:
                raise SessionNotFoundError("this server does not serve inference sessions")
            sessions = self.sessions
            session_id, ttl = await self._on_device(lambda: sessions.open(
                client, max_length=request.max_length, batch_size=max(request.batch_size, 1)))
            return pb.OpenSessionReply(session_id=session_id, idle_ttl_s=ttl)
        return await self._call(context, run, request)

    async def CloseSession(self, request: pb.CloseSessionRequest, context: Any) -> pb.CloseSessionReply:
        async def run() -> pb.CloseSessionReply:
            client, _ = self._identity(context)
            if self.sessions is None:
                raise SessionNotFoundError("this server does not serve inference sessions")
            sessions = self.sessions
            await self._on_device(lambda: sessions.close(client, request.session_id))
            return pb.CloseSessionReply()
        return await self._call(context, run, request)
