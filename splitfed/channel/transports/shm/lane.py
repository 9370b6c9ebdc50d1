"""The client's shared-memory lane: large tensors of a call go through its region, the call itself over gRPC.

:class:`SharedLane` opens a region on the trunk server the first time a
tensor is large enough (:data:`~splitfed.channel.transports.shm.regions.MIN_REGION_TENSOR_BYTES`),
or a small one with its first call for the region's direct-call link alone
(:meth:`SharedLane.inline`), and maps it; if the server offers none, or the region cannot be mapped (the
server is on another host), it says so once in the log and every tensor
travels over the socket from then on. Per call it takes a slice for the
request's tensor and one for the reply, copies the tensor in (from a GPU
straight into the region, which is registered with CUDA), sends the call, and
copies the reply out into memory of the caller's own. Compressed tensors never
take this lane (compression is for the socket). See :mod:`splitfed.channel.transports.shm.regions`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import grpc
import torch

from splitfed.channel.wire import fastwire
from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.transports.shm.devmem import DeviceMemory, local_memory
from splitfed.channel.transports.direct.client import DirectLink, DirectRefused
from splitfed.channel.security.hosts import host_of, is_loopback
from splitfed.channel.transports.shm.regions import (
    MIN_REGION_TENSOR_BYTES,
    RegionEvents,
    SharedRegion,
    local_events,
)
from splitfed.channel.transports.shm.events import device_with_uuid
from splitfed.channel.wire.retry import RetryBudget
from splitfed.channel.transports.shm.slicecopy import give_slices, needed_bytes, read_reply, write_slices
from splitfed.channel.transports.shm.slices import ClientRegion, Slice, aligned
from splitfed.codec.tensors import EncodedTensor, WireDType, encode, torch_dtype, wire_dtype
from splitfed.errors import ChannelError, ConfigError, SharedMemoryUnavailableError
from splitfed.split.base import CutState

log = logging.getLogger(__name__)

#: The size of a region a lane opens for its direct-call link alone (its first calls' tensors were all small): room
#: for a few calls of tensors just above :data:`MIN_REGION_TENSOR_BYTES`; a larger tensor later opens a larger one.
LINK_REGION_BYTES = 1 << 20

MODES = ("auto", "on", "off")


class SharedLane:
    """A :class:`~splitfed.channel.client.trunk.TrunkClient`'s tensors through a shared-memory region.

    Args:
        client: the trunk client (its calls, identity and accounting).
        mode: ``auto`` (loopback addresses only), ``on`` or ``off``.
        nbytes: size of the region to ask for.
    """

    def __init__(self, client: Any, mode: str = "auto", nbytes: int = 64 << 20, direct: bool = True) -> None:
        if mode not in MODES:
            raise ConfigError(f"shared_memory must be one of {MODES}, got {mode!r}")
        if mode == "auto":
            mode = "on" if is_loopback(host_of(client.address)) else "off"
        self.client = client
        self.mode = mode
        self.nbytes = int(nbytes)
        #: Whether this lane's calls go straight to the engine when the server offers it (:mod:`.direct`).
        self.direct = direct
        self.region: ClientRegion | None = None
        self._lock = threading.Lock()
        self._reply_bytes: dict[str, int] = {}
        #: Payload bytes that crossed the cut through the region, the calls whose tensor did, and how many of
        #: those had their copies ordered by CUDA events.
        self.bytes = 0
        self.calls = 0
        self.ordered = 0
        #: Calls whose copies went device to device, through the region's GPU memory.
        self.on_gpu = 0
        #: Calls sent straight to the engine's direct-call socket rather than over gRPC.
        self.direct_calls = 0
        #: Of those, calls whose tensors went inline (too small for the region, or compressed): :meth:`inline`.
        self.inline_calls = 0
        #: The retry budget of direct calls (gRPC keeps its own for the channel's calls), across regions.
        self._retry_budget = RetryBudget.of(client.retry)
        #: Whether a region was ever asked for (:meth:`inline` asks for one only if not).
        self._asked = False

    @property
    def active(self) -> bool:
        """Whether a region is mapped and in use."""
        return self.region is not None and not self.region.broken

    def gpu_ordered(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (on a GPU) would cross through a region whose copies CUDA events order: then a
        call's result may stay on the device (``on_device``) and no host waits for a GPU."""
        plan = self._plan(tensor)
        return plan is not None and plan[0].orders(tensor.device)

    # -- the region ------------------------------------------------------------------------
    def _region(self, cuda: bool = False, need: int = 0, least: int = 4 << 20) -> ClientRegion | None:
        """The mapped region, or None when tensors travel over the socket. Opened on first use, sized for several
        calls of ``need`` bytes in flight (micro-batches), at least ``least`` and at most ``nbytes``."""
        if self.mode == "off":
            return None
        region = self.region
        if region is not None and not region.broken:
            return region
        with self._lock:
            region = self.region
            if region is not None and not region.broken:
                return region
            if region is not None:  # a call failed: its slices may still be written, so take a new region
                self.region = None
                self._drop(region)
            asked = min(self.nbytes, max(16 * need, least))
            self._asked = True
            try:
                reply = self.client._invoke("OpenRegion", self.client._stub.OpenRegion,
                                            pb.OpenRegionRequest(nbytes=asked, cuda_events=cuda,
                                                                 client_pid=os.getpid()))
            except ChannelError as exc:
                log.info("tensors travel over the socket: the trunk server at %s offers no shared memory (%s)",
                         self.client.address, exc.code)
                self.mode = "off"
                return None
            try:
                mapping = SharedRegion.attach(reply.region, reply.nbytes)
                events = None
                if reply.event_handles:
                    if reply.server_pid == os.getpid():
                        events = local_events(reply.region)
                    elif (index := device_with_uuid(reply.device_uuid)) is not None:
                        events = RegionEvents.open(index, list(reply.event_handles))
            except SharedMemoryUnavailableError as exc:
                log.info("tensors travel over the socket: %s", exc)
                self.mode = "off"
                self._close_remote(reply.region)
                return None
            if reply.nbytes < asked:  # the server's share per client: no larger region will be asked for
                self.nbytes = int(reply.nbytes)
            memory = self._device_memory(reply) if events is not None else None
            self.region = ClientRegion(mapping, events, reply.device_uuid, memory)
            if self.direct and reply.direct_path and reply.direct_ticket:
                self.region.direct = DirectLink(reply.direct_path, reply.direct_ticket, self.client.address,
                                                self.client.limits.max_message_bytes, self.client.retry,
                                                self._retry_budget)
            log.debug("tensors cross the cut through shared-memory region %s (%d bytes)", mapping.name,
                      mapping.nbytes)
            return self.region

    def _larger(self, region: ClientRegion, need: int, cuda: bool) -> ClientRegion | None:
        """A region with room for a call of ``need`` bytes, in place of ``region``, which has too little even
        when empty (its size came from the first calls' tensors). ``region`` is closed and a larger one opened
        only while no call holds a slice of it; None meanwhile, and when ``need`` is above what this client may
        ask for (``nbytes``): that call then goes over the socket. Should the server not open the larger one (its
        regions are full), the next calls open one of the old size again, and none larger is asked for."""
        if need > self.nbytes or not region.retire_if_idle():
            return None
        log.debug("region %s (%d bytes) cannot hold a call of %d bytes: opening a larger one", region.name,
                  region.mapping.nbytes, need)
        larger = self._region(cuda, need)
        if larger is None and self.mode == "off":
            with self._lock:
                self.mode, self.nbytes = "on", min(self.nbytes, region.mapping.nbytes)
        return larger if larger is not None and need <= larger.mapping.nbytes else None

    @staticmethod
    def _device_memory(reply: pb.OpenRegionReply) -> DeviceMemory | None:
        """The region's twin in the trunk's GPU memory, mapped into this process (None: there is none, or it
        cannot be mapped here; the GPU copies then go through the region's file)."""
        if not reply.device_memory:
            return None
        if reply.server_pid == os.getpid():
            return local_memory(reply.region)
        index = device_with_uuid(reply.device_uuid)
        if index is None:
            return None
        try:
            return DeviceMemory.open(bytes(reply.device_memory), int(reply.nbytes), index)
        except SharedMemoryUnavailableError as exc:
            log.info("region %s: GPU copies go through host memory (%s)", reply.region, exc)
            return None

    def forget_direct(self) -> None:
        """Send the region's calls over gRPC from now on (the client's identity changed: its ticket runs as the old
        one); the next region opened comes with a ticket of its own."""
        _drop_link(self.region)

    def _close_remote(self, name: str) -> None:
        try:
            self.client._stub.CloseRegion(pb.CloseRegionRequest(region=name), timeout=2.0,
                                          metadata=self.client._metadata)
        except grpc.RpcError:
            pass  # the server closes it when this client leaves, or when it stops

    def _drop(self, region: ClientRegion) -> None:
        region.close()
        self._close_remote(region.name)

    def close(self) -> None:
        """Unmap the region and ask the server to close it."""
        with self._lock:
            region, self.region = self.region, None
        if region is not None:
            self._drop(region)

    # -- calls -----------------------------------------------------------------------------
    def _plan(self, tensor: torch.Tensor) -> tuple[ClientRegion, WireDType, int] | None:
        """The region, wire dtype and bytes for ``tensor``, or None when it travels over the socket."""
        if self.mode == "off" or not tensor.is_floating_point():
            return None
        wdt = self.client.wire_dtype
        nbytes = tensor.numel() * torch_dtype(wdt).itemsize
        if nbytes < MIN_REGION_TENSOR_BYTES:
            return None
        region = self._region(cuda=tensor.is_cuda, need=nbytes)
        return None if region is None else (region, wdt, nbytes)

    def forward(self, lane: Any, req: pb.ForwardRequest, state: CutState, on_device: bool = False
                ) -> tuple[Any, torch.Tensor] | None:
        """A Forward whose hidden state goes through the region: ``(reply header, output hidden)``, or None
        when it must travel over the socket. ``on_device``: a hidden state on a GPU gets its output there (a
        copy the GPU orders; the host does not wait), else the output is in host memory of its own."""
        plan = self._plan(state.hidden)
        if plan is None:
            return None
        region, wdt, nbytes = plan
        others = {name: t for name, t in state.tensors().items() if name != "hidden"}
        return self._call("Forward", lane.forward, req, region, ("hidden", state.hidden, wdt), others,
                          self._reply_bytes.get("forward", nbytes), on_device)

    def backward(self, lane: Any, req: pb.BackwardRequest, grad: torch.Tensor, input_numel: int | None,
                 on_device: bool = False) -> tuple[Any, torch.Tensor] | None:
        """A Backward whose gradients go through the region: ``(reply header, input gradient)``, or None.
        ``on_device``: as for :meth:`forward`."""
        plan = self._plan(grad)
        if plan is None:
            return None
        region, wdt, nbytes = plan
        guess = input_numel * torch_dtype(wdt).itemsize if input_numel else self._reply_bytes.get("backward", nbytes)
        return self._call("Backward", lane.backward, req, region, ("grad", grad, wdt), {}, guess, on_device)

    def _call(self, name: str, fn: Callable[..., Any], req: Any, region: ClientRegion,
              main: tuple[str, torch.Tensor, WireDType], others: dict[str, torch.Tensor], reply_guess: int,
              on_device: bool = False) -> tuple[Any, torch.Tensor] | None:
        """One call with ``main`` in the region; ``others`` (masks, positions) inline, or in the region too when
        CUDA events order the copies (reading a GPU tensor on the host would wait for the GPU)."""
        tensor = main[1]
        need = aligned(tensor.numel() * torch_dtype(main[2]).itemsize) + aligned(max(reply_guess,
                                                                                   MIN_REGION_TENSOR_BYTES))
        if need > region.mapping.nbytes:
            larger = self._larger(region, need, tensor.is_cuda)
            if larger is None:
                return None
            region = larger
        events = region.take_events() if region.orders(tensor.device) else None
        twin = events is not None and region.device_memory is not None  # the copies stay on the GPU
        sends = [(main[0], tensor.detach(), main[2])]
        small: list[EncodedTensor] = []
        for other, t in others.items():
            if events is not None and t.is_cuda:
                sends.append((other, t.detach(), wire_dtype(t.dtype)))
            else:
                small.append(encode(other, t))
        slices: list[Slice] = []
        for _, t, wdt in sends:
            piece = region.take(t.numel() * torch_dtype(wdt).itemsize, device=twin)
            if piece is None:
                break
            slices.append(piece)
        dst = region.take(max(reply_guess, MIN_REGION_TENSOR_BYTES), device=twin) \
            if len(slices) == len(sends) else None
        if dst is None:  # no room now: this call goes over the socket
            give_slices(region, slices, events)
            return None
        slices.append(dst)
        try:
            encs, reply = write_slices(region, sends, slices, events)
            req.reply_region.CopyFrom(fastwire.region_slice(reply))
            parsed, direct = self._invoke(name, fn, region, fastwire.Parsed(req, [*encs, *small]))
            out, received = self._reply(name, parsed.tensors, region, dst,
                                        tensor.device if tensor.is_cuda else None, on_device)
        except ChannelError as exc:
            needed = needed_bytes(exc)
            if needed is not None and needed <= region.mapping.nbytes // 2 and needed > reply_guess:
                # The reply outgrew the slice offered (the trunk's output is larger than its input); the server
                # dropped the forward and wrote nothing: offer enough and send again.
                give_slices(region, slices, events)
                with self._lock:
                    self._reply_bytes[name.lower()] = needed
                return self._call(name, fn, req, region, main, others, needed, on_device)
            region.poison()
            if exc.code == "NOT_FOUND" and "region" in str(exc):  # the server closed it (restarted, or idle):
                log.info("shared-memory region %s is gone on the server; opening another", region.name)
                req.ClearField("reply_region")  # checked before the trunk ran, so nothing happened: go on
                return None  # over the socket this time
            raise
        except BaseException:
            region.poison()
            raise
        give_slices(region, slices, events)
        moved = sum(e.region.nbytes for e in encs if e.region is not None)
        self.client._account(moved + sum(e.wire_nbytes for e in small), received)
        with self._lock:
            self.bytes += moved + (received if parsed.tensors[0].region is not None else 0)
            self.calls += 1
            self.ordered += events is not None
            self.on_gpu += twin
            self.direct_calls += direct
        return parsed.header, out

    def _invoke(self, name: str, fn: Callable[..., Any], region: ClientRegion, request: fastwire.Parsed
                ) -> tuple[fastwire.Parsed, bool]:
        """The call's reply, straight from the engine when the region came with a direct-call link that works,
        else over gRPC; and whether it went direct."""
        reply = self._direct(name, region, request)
        if reply is not None:
            return reply, True
        return self.client._invoke(name, fn, request), False

    def _direct(self, name: str, region: ClientRegion, request: fastwire.Parsed) -> fastwire.Parsed | None:
        """The call's reply over the region's direct-call link, or None when it has none or the engine refused it
        (nothing was sent: this and later calls go over gRPC)."""
        link = region.direct
        if link is None:
            return None
        try:
            return link.call(name, request, self.client.retry.timeout_s)
        except DirectRefused as exc:
            log.info("calls go over gRPC: %s", exc)
            _drop_link(region)
            return None

    def inline(self, name: str, request: fastwire.Parsed, cuda: bool = False) -> fastwire.Parsed | None:
        """A unary Forward or Backward whose tensors travel inline (too small for the region, or compressed) sent
        over the direct-call link of this lane's region: the same bytes as over gRPC, run by the same handlers as
        that client, without gRPC's way on either side. None: no such link, send it over gRPC.

        A lane that may use shared memory and never had a region opens a small one (:data:`LINK_REGION_BYTES`) for
        its link, so a client on the trunk's host whose tensors are all small (decode steps, a small CNN's cut)
        skips gRPC too; ``cuda``: the caller computes on a GPU (the region gets CUDA events, as a large tensor's
        would)."""
        region = self.region
        if region is None and self.direct and self.mode != "off" and not self._asked:
            region = self._region(cuda=cuda, least=LINK_REGION_BYTES)
        if region is None or region.broken or region.direct is None:
            return None
        try:
            reply = self._direct(name, region, request)
        except ChannelError as exc:
            if exc.code != "UNAUTHENTICATED":
                raise
            # Nothing ran: the region's ticket ended (the region was closed meanwhile; no slice of this call held
            # it open), or the token did. gRPC answers this call and the later ones, as its own.
            log.info("small calls go over gRPC: %s", exc)
            _drop_link(region)
            return None
        if reply is not None:
            with self._lock:
                self.direct_calls += 1
                self.inline_calls += 1
        return reply

    def _reply(self, call: str, encs: list[EncodedTensor], region: ClientRegion, dst: Slice,
               device: torch.device | None, on_device: bool) -> tuple[torch.Tensor, int]:
        """The reply's one tensor in memory of its own, and its bytes (:func:`read_reply`); a reply that did not fit
        the slice offered is offered more next time."""
        out, nbytes, inline = read_reply(call, encs, region, dst, device, on_device, self.client.tensor_limits)
        if inline:
            with self._lock:
                self._reply_bytes[call.lower()] = max(self._reply_bytes.get(call.lower(), 0), nbytes)
        return out, nbytes


def _drop_link(region: ClientRegion | None) -> None:
    """Send ``region``'s calls over gRPC from now on: close its direct-call link, if it has one."""
    if region is not None and region.direct is not None:
        link, region.direct = region.direct, None
        link.close()
