"""The trunk server's reads and writes of its clients' shared-memory regions (see :mod:`splitfed.channel.transports.shm.regions`).

A request's tensor in a region is copied into memory of the server's own before
anything looks at it. Without a CUDA event the client's bytes are complete when
the call arrives: they are copied into host memory and decoded like bytes from
the socket. With one (client and trunk both on a GPU), the trunk's stream
waits for the client's copy and copies the bytes straight to the device; the
host never waits, so neither side's GPU idles while the other launches work.
Such tensors are checked for NaN/Inf on the device and the verdict is read
once the Backward's step is done (:meth:`RegionIO.verdict`), each check's
answer copied to the host behind it (:class:`~splitfed.codec.finite.FiniteFlag`), so
that reading it waits for the check alone and never for the backward and step
queued after it: the GPU is not left idle while the reply goes out. A
non-finite trunk gradient is never applied either way (the gradient guard).

Replies go into the slice the request offered when they are raw and fit,
from the device or from host memory, with the request's reply event recorded
after the copy. An event-ordered slice may lie in the region's twin in GPU
memory (:mod:`splitfed.channel.transports.shm.devmem`): the copies in and out are then
device-to-device.
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from typing import Any

import torch

from splitfed.channel.wire import fastwire
from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.transports.shm.regions import RegionTable, SharedRegion, copy_into, device_uuid, host_copy
from splitfed.codec.tensors import EncodedTensor, RegionRef, WireDType, declared_nbytes, torch_dtype, wire_dtype
from splitfed.errors import (
    CodecError,
    ResourceExhaustedError,
    SharedMemoryUnavailableError,
    SplitFedError,
    TensorValueError,
)
from splitfed.codec.finite import FiniteFlag
from splitfed.trunk.device.transfers import Arrival, DeviceIO

#: Verdicts kept for training forwards whose Backward has not come yet.
MAX_PENDING_VERDICTS = 4096
#: Floating tensors of at least this many bytes in a registered region go straight to a trunk's GPU; smaller ones
#: are copied and checked on the host, where that costs less than a read of the device's verdict.
ARRIVAL_MIN_BYTES = 1 << 16


class RegionIO:
    """One servicer's access to the regions of ``table``.

    Args:
        table: the server's regions.
        device: the trunk's device (CUDA: tensors with an event go straight there).
        max_bytes: the largest tensor a request may name.
    """

    def __init__(self, table: RegionTable, device: torch.device, max_bytes: int, io: DeviceIO | None = None) -> None:
        self.table = table
        self.device = device
        self.max_bytes = max_bytes
        self.io = io
        self._verdicts: OrderedDict[tuple[str, str], list[FiniteFlag]] = OrderedDict()

    # -- requests ----------------------------------------------------------------------------
    def resolve(self, client: str, tensors: list[EncodedTensor], arrive: bool = True
                ) -> tuple[list[EncodedTensor], dict[str, torch.Tensor], list[FiniteFlag], list[Arrival]]:
        """The request's tensors: those in ``client``'s region copied out (host bytes, or device tensors when an
        event orders the copy), the device tensors' finiteness flags (read later, see :meth:`verdict`), and
        the large ones the device thread brings from the region itself (:class:`~splitfed.trunk.device.transfers.Arrival`,
        placeholders in ``ready`` until then; ``arrive=False``: none)."""
        out: list[EncodedTensor] = []
        ready: dict[str, torch.Tensor] = {}
        flags: list[FiniteFlag] = []
        arrivals: list[Arrival] = []
        for enc in tensors:
            ref = enc.region
            if ref is None:
                out.append(enc)
                continue
            if enc.compressed is not None or len(enc.data):
                raise CodecError(f"tensor {enc.name!r} names a region and also carries bytes or compression; a "
                                 "tensor in a region travels raw and only there")
            need = declared_nbytes(enc.dtype, enc.shape)
            if ref.nbytes != need:
                raise CodecError(f"tensor {enc.name!r} of shape {list(enc.shape)} needs {need} bytes but names a "
                                 f"slice of {ref.nbytes}")
            if need > self.max_bytes:
                raise ResourceExhaustedError(f"tensor {enc.name!r} declares {need} bytes, above the limit of "
                                             f"{self.max_bytes}")
            region = self.table.region(client, ref.region)
            src = region.where(ref)
            if arrive and not ref.event and self.io is not None and (region.registered or not self.io.cuda) \
                    and need >= ARRIVAL_MIN_BYTES and torch_dtype(enc.dtype).is_floating_point:
                # The client's bytes are complete: the device thread copies them from the region into memory of
                # the server's own (on the GPU, by the copy engine from the registered region) and checks them
                # there, with the rest of its batch; the region stays mapped meanwhile (SharedRegion.reading).
                arrival = self.io.stage(enc.name, src, torch_dtype(enc.dtype), enc.shape, guard=region.reading,
                                        pinned=region.registered)
                ready[enc.name] = arrival.placeholder
                arrivals.append(arrival)
                continue
            if not ref.event:
                own = host_copy(src, pinned=self.table.pin)
                out.append(EncodedTensor(enc.name, enc.dtype, enc.shape, memoryview(own.numpy())))
                continue
            tensor = self._to_device(enc, region, ref, src)
            if tensor.is_floating_point():
                flags.append(FiniteFlag.of(tensor))
            ready[enc.name] = tensor
        return out, ready, flags, arrivals

    def _to_device(self, enc: EncodedTensor, region: SharedRegion, ref: RegionRef, src: torch.Tensor
                   ) -> torch.Tensor:
        event = self._event(region, ref)
        dtype = torch_dtype(enc.dtype)
        if not src.numel():
            raise TensorValueError(f"tensor {enc.name!r} is empty (shape {list(enc.shape)}); send at least one "
                                   "element")
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(event)  # the client's copy into the region comes first, on the GPU's time
        own = torch.empty(src.shape, dtype=torch.uint8, device=self.device)
        own.copy_(src, non_blocking=True)
        return own.view(dtype).view(enc.shape)

    def _event(self, region: SharedRegion, ref: RegionRef) -> torch.cuda.Event:
        if region.events is None or self.device.type != "cuda":
            raise CodecError(f"slice names CUDA event {ref.event} but region {ref.region} has no events (the trunk "
                             "or the client is not on a GPU)")
        return region.events[ref.event]

    def reply_slot(self, client: str, request: Any) -> RegionRef | None:
        """The slice a request offers for its reply, checked before the request touches the trunk."""
        if not request.HasField("reply_region"):
            return None
        ref = fastwire.region_ref(request.reply_region)
        region = self.table.region(client, ref.region)
        region.where(ref)
        if ref.event:
            self._event(region, ref)
        return ref

    # -- replies ------------------------------------------------------------------------------
    def place(self, client: str, slot: RegionRef, name: str, out: torch.Tensor, reply_dtype: WireDType | None
              ) -> EncodedTensor | None:
        """``out`` written into ``slot`` in ``reply_dtype`` (the slot's event recorded after the copy); None
        when it does not fit there or the region is gone (the bytes then travel in the reply)."""
        wdt = reply_dtype or wire_dtype(out.dtype)
        t = out.detach().to(torch_dtype(wdt))
        nbytes = t.numel() * t.element_size()
        if nbytes > slot.nbytes:
            return None
        ref = RegionRef(slot.region, slot.offset, nbytes, slot.event, slot.device)
        try:
            region = self.table.region(client, slot.region)
            dst = region.where(ref)
        except SplitFedError:  # closed meanwhile (an idle sweep)
            return None
        if nbytes:
            copy_into(dst, t.contiguous().reshape(-1).view(torch.uint8), non_blocking=t.is_cuda or dst.is_cuda)
        if slot.event:
            self._event(region, slot).record(torch.cuda.current_stream(self.device))
        return EncodedTensor(name, wdt, tuple(t.shape), b"", None, ref)

    def place_async(self, client: str, slot: RegionRef, name: str, out: torch.Tensor,
                    reply_dtype: WireDType | None) -> tuple[EncodedTensor, torch.cuda.Event] | None:
        """``out`` (on the trunk's GPU) copied into ``slot`` of a registered region in ``reply_dtype`` by the copy
        engine, with no host thread waiting: the reply's tensor and the event after which the bytes are there.
        None when it does not fit, the region is gone or not registered (the caller takes another path)."""
        assert self.io is not None
        wdt = reply_dtype or wire_dtype(out.dtype)
        dtype = torch_dtype(wdt)
        nbytes = out.numel() * dtype.itemsize
        if nbytes > slot.nbytes:
            return None
        ref = RegionRef(slot.region, slot.offset, nbytes, slot.event, slot.device)
        try:
            region = self.table.region(client, slot.region)
            dst = region.where(ref)
        except SplitFedError:  # closed meanwhile (an idle sweep)
            return None
        if not region.registered:
            return None
        departure = self.io.to_host(out, dtype, dst=dst)
        region.hold(departure.event)
        return EncodedTensor(name, wdt, tuple(out.shape), b"", None, ref), departure.event

    # -- deferred checks ----------------------------------------------------------------------
    def keep(self, client: str, activation_id: str, flags: list[FiniteFlag]) -> None:
        """Keep a training forward's flags for its Backward's verdict."""
        if flags:
            self._verdicts[(client, activation_id)] = flags
            while len(self._verdicts) > MAX_PENDING_VERDICTS:
                self._verdicts.popitem(last=False)

    def verdict(self, client: str, activation_id: str, flags: list[FiniteFlag]) -> None:
        """Raise :class:`TensorValueError` if the forward's input or the gradient held NaN or Inf.

        Called once the Backward's step is done. Each flag's read waits for its own check only, not for the
        backward and step queued after it, so the reply leaves with the GPU still busy.
        """
        flags = self._verdicts.pop((client, activation_id), []) + flags
        if not all([flag.read() for flag in flags]):
            raise TensorValueError(f"the forward's input or the gradient of {activation_id} held NaN or Inf "
                                   "(tensors through a GPU-ordered region are checked once the step is done; a "
                                   "non-finite trunk gradient is never applied)")


class RegionService:
    """The servicer's shared-memory part (a mixin of :class:`~splitfed.channel.server.servicer.SplitChannelServicer`):
    the OpenRegion and CloseRegion calls, and a request's tensors in and its reply out of a region."""

    runtime: Any
    replies: Any
    tensor_limits: Any
    _io: RegionIO | None
    _call: Any
    _identity: Any
    #: The server's direct-call socket (:class:`~splitfed.channel.transports.direct.server.DirectCalls`; None: it offers none).
    direct: Any = None

    @property
    def regions(self) -> RegionTable | None:
        """Shared-memory regions of clients on this host (None: tensors travel over the socket only)."""
        return None if self._io is None else self._io.table

    @regions.setter
    def regions(self, table: RegionTable | None) -> None:
        self._io = None if table is None else RegionIO(table, self.runtime.device, self.tensor_limits.max_bytes,
                                                       getattr(self.runtime, "io", None))

    def _region_io(self) -> RegionIO:
        if self._io is None:
            raise SharedMemoryUnavailableError("this trunk server offers no shared memory; send tensor bytes "
                                               "in the message")
        return self._io

    def _resolve(self, client: str, tensors: list[EncodedTensor], arrive: bool = True
                 ) -> tuple[list[EncodedTensor], dict[str, torch.Tensor], list[FiniteFlag], list[Arrival]]:
        if all(enc.region is None for enc in tensors):
            return tensors, {}, [], []
        return self._region_io().resolve(client, tensors, arrive)

    def _reply_slot(self, client: str, request: Any) -> RegionRef | None:
        return self._region_io().reply_slot(client, request) if request.HasField("reply_region") else None

    # -- calls -------------------------------------------------------------------------------------
    async def OpenRegion(self, request: pb.OpenRegionRequest, context: Any) -> pb.OpenRegionReply:
        async def run() -> pb.OpenRegionReply:
            client, _ = self._identity(context)
            table = self._region_io().table
            device = self.runtime.device
            events = device.index if device.index is not None else 0
            on = events if request.cuda_events and table.pin and device.type == "cuda" else None
            region = await asyncio.get_running_loop().run_in_executor(None, table.open, client, request.nbytes, on,
                                                                      int(request.client_pid))
            path, ticket = ("", "") if self.direct is None else self.direct.issue(
                context.invocation_metadata() or (), context.peer(), client, region.name)
            return pb.OpenRegionReply(direct_path=path, direct_ticket=ticket, region=region.name,
                                      path=str(region.path), nbytes=region.nbytes,
                                      event_handles=[] if region.events is None else region.events.handles(),
                                      server_pid=os.getpid(), device=events,
                                      device_uuid=device_uuid(events) if region.events is not None else "",
                                      device_memory=b"" if region.device_memory is None else
                                      region.device_memory.handle())
        return await self._call(context, run, request)

    async def CloseRegion(self, request: pb.CloseRegionRequest, context: Any) -> pb.CloseRegionReply:
        async def run() -> pb.CloseRegionReply:
            client, _ = self._identity(context)
            self._region_io().table.close(client, request.region)
            if self.direct is not None:
                self.direct.revoke(client, request.region)
            return pb.CloseRegionReply()
        return await self._call(context, run, request)
