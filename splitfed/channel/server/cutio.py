"""The servicer's side of the cut's copies: a streamed request gathered as it arrives, a request's large tensors
handed to the device thread, and each reply taken back from where the device thread sent it.

A mixin of :class:`~splitfed.channel.server.servicer.SplitChannelServicer`. With the trunk on a GPU, nothing here waits
on the device: tensors that came as bytes are staged in pinned memory on copy threads
(:class:`~splitfed.trunk.device.transfers.Arrival`); replies come back as copies in flight
(:class:`~splitfed.trunk.device.transfers.Departure`), whose events one waiter thread awaits for every handler.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import torch

from splitfed.channel.wire import fastwire
from splitfed.channel.transports.shm import serverio as regionio
from splitfed.channel.server.handlers import check_parsed
from splitfed.channel.engine.loop import awaiting
from splitfed.channel.wire.messages import Assembled, Gather
from splitfed.codec.tensors import (
    CompressionMethod,
    EncodedTensor,
    RegionRef,
    WireDType,
    decode_packed,
    encode_packed,
    raw_nbytes,
    torch_dtype,
    wire_dtype,
)
from splitfed.codec.compression import Packed
from splitfed.errors import CodecError, ResourceExhaustedError, SplitFedError
from splitfed.trunk.device.transfers import Departure, EventWaiter, ReplySink

#: Threads that copy received bytes into pinned memory for a trunk on a GPU (numpy's copy releases the GIL).
COPY_THREADS = 4


def _pinned(data: Any) -> bool:
    """Whether ``data`` (a request's bytes) lies in pinned host memory (gathered there by a streamed request)."""
    return isinstance(data, memoryview) and not data.readonly and len(data) > 0 \
        and torch.frombuffer(data, dtype=torch.uint8).is_pinned()


class CutIO:
    """Arrivals in and replies out for a servicer (see the module docstring)."""

    runtime: Any
    limits: Any
    replies: Any
    tensor_limits: Any
    _io: Any
    _region_io: Any
    _copier: concurrent.futures.ThreadPoolExecutor | None = None
    _event_waiter: EventWaiter | None = None
    _bulk_take: Any

    async def _arrive(self, tensors: list, name: str, ready: dict, arrivals: list) -> list:
        """A request's main tensor (``name``) that came as bytes, handed to the device thread as an
        :class:`~splitfed.trunk.device.transfers.Arrival` (for a GPU, copied into a pinned buffer first, on a copy thread):
        it joins ``ready`` (as a placeholder) and ``arrivals``; the tensors left to decode here are returned."""
        io = getattr(self.runtime, "io", None)
        if io is None:
            return tensors
        left = []
        for enc in tensors:
            int8 = io.cuda and enc.compressed is not None and enc.compressed.method == CompressionMethod.INT8_BLOCKWISE
            if enc.name != name or (enc.compressed is not None and not int8) or enc.region is not None \
                    or len(enc.data) < regionio.ARRIVAL_MIN_BYTES \
                    or not (int8 or torch_dtype(enc.dtype).is_floating_point):
                left.append(enc)
                continue
            if name in ready:
                raise CodecError(f"tensor {name!r} appears twice")
            if int8:  # checked here, rebuilt on the GPU: half the bytes of bf16 cross to it, and no host pass
                packed = decode_packed(enc, self.tensor_limits)
                stage = functools.partial(io.stage, enc.name, enc.data, packed.dtype, tuple(enc.shape), owned=True,
                                          scales=enc.compressed.scales, block_size=packed.block_size)
            else:
                raw_nbytes(enc, self.tensor_limits)
                stage = functools.partial(io.stage, enc.name, enc.data, torch_dtype(enc.dtype), tuple(enc.shape),
                                          owned=True)
            if io.cuda and not _pinned(enc.data):
                if self._copier is None:
                    self._copier = concurrent.futures.ThreadPoolExecutor(COPY_THREADS, "splitfed-trunk-copy")
                arrival = await asyncio.get_running_loop().run_in_executor(self._copier, stage)
            else:  # the request's bytes are the server's own: nothing to copy
                arrival = stage()
            ready[name] = arrival.placeholder
            arrivals.append(arrival)
        return left

    async def _gather(self, requests: AsyncIterator[Any], field: str, client: str = "", context: Any = None
                      ) -> Assembled:
        """A streamed request put together as its frames arrive (each chunk copied into place as it comes, while
        the rest is still on the way), refusing more bytes than a request may carry. For a trunk on a GPU the
        bytes gather in pinned memory, from which the copy engine reads them with no copy of their own. A header
        that names a bulk transfer takes its bytes from ``client``'s bulk link instead."""
        gather, total = None, 0
        budget = self.limits.max_tensor_bytes + self.limits.max_message_bytes
        async for frame in requests:
            check_parsed(frame)
            total += len(getattr(frame, "data", b"")) if isinstance(frame, fastwire.ChunkView) else frame.ByteSize()
            if total > budget:
                raise ResourceExhaustedError(f"streamed request exceeds {budget} bytes")
            if gather is None:
                gather = Gather(frame, field, self.limits.max_tensor_bytes, self._gather_alloc())
            else:
                gather.feed(frame)
        if gather is None:
            Gather(None, field, self.limits.max_tensor_bytes)  # raises: nothing came
        if gather.bulk is not None and gather.total:  # a header that declares no bytes waits for none
            await self._bulk_take(client, gather, context)
        return gather.done()

    def _gather_alloc(self) -> Callable[[int], np.ndarray] | None:
        """What a streamed request's bytes gather in: pinned pool memory for a trunk on a GPU (staged then with
        no copy), else numpy's."""
        io = getattr(self.runtime, "io", None)
        return io.host_buffer if io is not None and io.cuda else None

    def _sink(self, client: str, slot: RegionRef | None, spec: Any, reply_dtype: WireDType | None
              ) -> ReplySink | None:
        """Where the device thread sends a reply's tensor computed on a GPU: the offered slice of a registered
        region when it fits there, else a pinned buffer. None on the CPU, for a slice that a CUDA event orders
        (see ``device_out``), and for a compressed reply (``spec``), which :meth:`_reply` compresses on the GPU."""
        io = getattr(self.runtime, "io", None)
        if io is None or not io.cuda or (slot is not None and slot.event) or spec is not None:
            return None
        dtype = torch_dtype(reply_dtype) if reply_dtype else None
        if slot is not None and self._io is not None:
            try:
                region = self._io.table.region(client, slot.region)
            except SplitFedError:
                return ReplySink(dtype)
            if region.registered:
                return ReplySink(dtype, region.where(slot), region.hold)
        return ReplySink(dtype)

    async def _reply(self, client: str, activation_id: str, name: str, out: Any,
                     reply_dtype: WireDType | None, spec: Any, slot: RegionRef | None, feedback: bool = True,
                     sink: ReplySink | None = None) -> list[EncodedTensor]:
        """The reply's tensor: into the offered slice when it is raw and fits there, else as bytes.

        An output on the trunk's GPU travels by the copy engine (:class:`~splitfed.trunk.device.transfers.DeviceIO`),
        sent by the device thread to this call's ``sink`` (a :class:`~splitfed.trunk.device.transfers.Departure`), or
        copied here: into the client's registered region, or into pinned memory to be sent as bytes. The handler
        awaits the copy's event; no thread of the server waits on the device meanwhile but the event waiter's.
        """
        if isinstance(out, Departure):
            await self._landed(out.event)
            if out.direct and out.sink is sink and slot is not None:
                host = out.host
                nbytes = host.numel() * host.element_size()
                ref = RegionRef(slot.region, slot.offset, nbytes, slot.event, slot.device)
                return [EncodedTensor(name, wire_dtype(host.dtype), tuple(host.shape), b"", None, ref)]
            out = out.device if out.direct else out.host  # a retried call's slice is another: copy again
        io = getattr(self.runtime, "io", None)
        if slot is not None and spec is None and out.is_floating_point():
            if out.is_cuda and not slot.event and io is not None:
                done = self._region_io().place_async(client, slot, name, out, reply_dtype)
                if done is not None:
                    await self._landed(done[1])
                    return [done[0]]
            else:
                placed = self._region_io().place(client, slot, name, out, reply_dtype)
                if placed is not None:
                    return [placed]
        if out.device.type != "cpu":  # a device output that could not take its slice
            if io is not None and out.is_cuda and spec is not None and out.is_floating_point():
                packed = self.replies.pack(client, activation_id, name, out, reply_dtype, spec, feedback=feedback)
                return [encode_packed(name, await self._packed_to_host(io, packed))]
            if io is not None and out.is_cuda:
                raw = spec is None and out.is_floating_point() and reply_dtype is not None
                departure = io.to_host(out, torch_dtype(reply_dtype) if raw else None)  # type: ignore[arg-type]
                await self._landed(departure.event)
                out = departure.host
            else:
                out = out.cpu()
        return [self.replies.encode(client, activation_id, name, out, reply_dtype, spec, feedback=feedback)]

    async def _packed_to_host(self, io: Any, packed: Packed) -> Packed:
        """A reply compressed on the GPU (:meth:`~splitfed.channel.wire.messages.ReplyCompression.pack`), its parts copied
        to pinned memory by the copy engine (in order on one stream: the last part's event ends them all)."""
        parts = {f: getattr(packed, f) for f in ("payload", "scales", "indices") if getattr(packed, f) is not None}
        copies = {f: io.to_host(t) for f, t in parts.items()}
        await self._landed(list(copies.values())[-1].event)
        io.stats["out-packed"] += 1
        return dataclasses.replace(packed, **{f: c.host for f, c in copies.items()})

    async def _landed(self, event: Any) -> None:
        """Wait, holding no thread, until a copy ending with ``event`` is done."""
        if event.query():
            return
        waiter = self._event_waiter
        if waiter is None:
            waiter = self._event_waiter = EventWaiter()
        await awaiting(waiter.when_done(event))

    def close(self) -> None:
        """Stop the servicer's helper threads (the server stopped)."""
        if self._copier is not None:
            self._copier.shutdown(wait=False)
        if self._event_waiter is not None:
            self._event_waiter.stop()
