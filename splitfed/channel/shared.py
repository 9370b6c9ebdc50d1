"""The client's shared-memory lane: large tensors of a call go through its region, the call itself over gRPC.

:class:`SharedLane` opens a region on the trunk server the first time a
tensor is large enough (:data:`~splitfed.channel.regions.MIN_REGION_TENSOR_BYTES`)
and maps it; if the server offers none, or the region cannot be mapped (the
server is on another host), it says so once in the log and every tensor
travels over the socket from then on. Per call it takes a slice for the
request's tensor and one for the reply, copies the tensor in (from a GPU
straight into the region, which is registered with CUDA), sends the call, and
copies the reply out into memory of the caller's own. Compressed tensors never
take this lane (compression is for the socket). See :mod:`splitfed.channel.regions`.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import torch

from splitfed.channel import fastwire
from splitfed.channel import split_channel_pb2 as pb
from splitfed.channel.regions import MIN_REGION_TENSOR_BYTES, ClientRegion, SharedRegion, Slice
from splitfed.channel.hosts import host_of, is_loopback
from splitfed.codec import EncodedTensor, WireDType, encode, torch_dtype
from splitfed.errors import ChannelError, CodecError, ConfigError, SharedMemoryUnavailableError, TensorValueError
from splitfed.split.base import CutState

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")


class SharedLane:
    """A :class:`~splitfed.channel.client.TrunkClient`'s tensors through a shared-memory region.

    Args:
        client: the trunk client (its calls, identity and accounting).
        mode: ``auto`` (loopback addresses only), ``on`` or ``off``.
        nbytes: size of the region to ask for.
    """

    def __init__(self, client: Any, mode: str = "auto", nbytes: int = 64 << 20) -> None:
        if mode not in MODES:
            raise ConfigError(f"shared_memory must be one of {MODES}, got {mode!r}")
        if mode == "auto":
            mode = "on" if is_loopback(host_of(client.address)) else "off"
        self.client = client
        self.mode = mode
        self.nbytes = int(nbytes)
        self.region: ClientRegion | None = None
        self._lock = threading.Lock()
        self._reply_bytes: dict[str, int] = {}
        #: Payload bytes that crossed the cut through the region, and the calls whose tensor did.
        self.bytes = 0
        self.calls = 0

    @property
    def active(self) -> bool:
        """Whether a region is mapped and in use."""
        return self.region is not None and not self.region.broken

    # -- the region ------------------------------------------------------------------------
    def _region(self) -> ClientRegion | None:
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
            try:
                reply = self.client._invoke("OpenRegion", self.client._stub.OpenRegion,
                                            pb.OpenRegionRequest(nbytes=self.nbytes))
            except ChannelError as exc:
                log.info("tensors travel over the socket: the trunk server at %s offers no shared memory (%s)",
                         self.client.address, exc.code)
                self.mode = "off"
                return None
            try:
                mapping = SharedRegion.attach(reply.region, reply.nbytes)
            except SharedMemoryUnavailableError as exc:
                log.info("tensors travel over the socket: %s", exc)
                self.mode = "off"
                self._close_remote(reply.region)
                return None
            self.region = ClientRegion(mapping)
            log.debug("tensors cross the cut through shared-memory region %s (%d bytes)", mapping.name,
                      mapping.nbytes)
            return self.region

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
        region = self._region()
        return None if region is None else (region, wdt, nbytes)

    def forward(self, lane: Any, req: pb.ForwardRequest, state: CutState) -> tuple[Any, torch.Tensor] | None:
        """A Forward whose hidden state goes through the region: ``(reply header, output hidden)``, or None
        when it must travel over the socket."""
        plan = self._plan(state.hidden)
        if plan is None:
            return None
        region, wdt, nbytes = plan
        small = [encode(name, t) for name, t in state.tensors().items() if name != "hidden"]
        return self._call("Forward", lane.forward, req, region, ("hidden", state.hidden, wdt, nbytes), small,
                          self._reply_bytes.get("forward", nbytes))

    def backward(self, lane: Any, req: pb.BackwardRequest, grad: torch.Tensor, input_numel: int | None
                 ) -> tuple[Any, torch.Tensor] | None:
        """A Backward whose gradients go through the region: ``(reply header, input gradient)``, or None."""
        plan = self._plan(grad)
        if plan is None:
            return None
        region, wdt, nbytes = plan
        guess = input_numel * torch_dtype(wdt).itemsize if input_numel else self._reply_bytes.get("backward", nbytes)
        return self._call("Backward", lane.backward, req, region, ("grad", grad, wdt, nbytes), [], guess)

    def _call(self, name: str, fn: Callable[..., Any], req: Any, region: ClientRegion,
              big: tuple[str, torch.Tensor, WireDType, int], small: Sequence[EncodedTensor], reply_guess: int
              ) -> tuple[Any, torch.Tensor] | None:
        tname, tensor, wdt, nbytes = big
        src = region.take(nbytes)
        dst = region.take(max(reply_guess, MIN_REGION_TENSOR_BYTES)) if src is not None else None
        if src is None or dst is None:  # no room now: this call goes over the socket
            if src is not None:
                region.give(src)
            return None
        try:
            dtype = torch_dtype(wdt)
            t = tensor.detach()
            if t.device.type == "cuda":
                region.pin()
                if t.dtype != dtype:
                    t = t.to(dtype)  # cast on the device: fewer bytes to copy
            src.tensor(dtype, tuple(t.shape)).copy_(t)
            req.reply_region.CopyFrom(fastwire.region_slice(dst.ref))
            encs = [EncodedTensor(tname, wdt, tuple(t.shape), b"", None, src.ref), *small]
            parsed = self.client._invoke(name, fn, fastwire.Parsed(req, encs))
            out, received = self._reply(name, parsed.tensors, region, dst, pinned=tensor.device.type == "cuda")
        except ChannelError as exc:
            needed = _needed_bytes(exc)
            if needed is not None and needed <= region.mapping.nbytes // 2 and needed > reply_guess:
                # The reply outgrew the slice offered (the trunk's output is larger than its input); the server
                # dropped the forward and wrote nothing: offer enough and send again.
                region.give(src)
                region.give(dst)
                with self._lock:
                    self._reply_bytes[name.lower()] = needed
                return self._call(name, fn, req, region, big, small, needed)
            region.poison()
            if exc.code == "NOT_FOUND" and "region" in str(exc):  # the server closed it (restarted, or idle):
                log.info("shared-memory region %s is gone on the server; opening another", region.name)
                req.ClearField("reply_region")  # checked before the trunk ran, so nothing happened: go on
                return None  # over the socket this time
            raise
        except BaseException:
            region.poison()
            raise
        region.give(src)
        region.give(dst)
        sent = nbytes + sum(e.wire_nbytes for e in small)
        self.client._account(sent, received)
        with self._lock:
            self.bytes += nbytes + (received if parsed.tensors[0].region is not None else 0)
            self.calls += 1
        return parsed.header, out

    def _reply(self, call: str, encs: list[EncodedTensor], region: ClientRegion, dst: Slice, pinned: bool
               ) -> tuple[torch.Tensor, int]:
        """The reply's one tensor in memory of its own (pinned when the caller computes on a GPU), and its bytes."""
        name = "hidden" if call == "Forward" else "grad"
        if len(encs) != 1 or encs[0].name != name:
            raise CodecError(f"expected exactly one tensor named {name!r}, got {[e.name for e in encs]}")
        enc = encs[0]
        if enc.region is None:  # it did not fit the slice offered: offer more next time
            from splitfed.channel.wire import decode_single

            out = decode_single(encs, name, self.client.tensor_limits)
            with self._lock:
                self._reply_bytes[call.lower()] = max(self._reply_bytes.get(call.lower(), 0), enc.wire_nbytes)
            return out, enc.wire_nbytes
        dtype = torch_dtype(enc.dtype)
        if not dtype.is_floating_point:
            raise TensorValueError(f"{name} must be a floating tensor, got {dtype}")
        view = region.reply(enc.region, dst, dtype, tuple(enc.shape))
        out = torch.empty(view.shape, dtype=dtype, pin_memory=pinned and torch.cuda.is_available())
        out.copy_(view)
        return out, enc.region.nbytes



def _needed_bytes(exc: ChannelError) -> int | None:
    """The reply size a RESOURCE_EXHAUSTED "use ForwardStream" error names (None for any other error)."""
    if exc.code != "RESOURCE_EXHAUSTED":
        return None
    found = re.search(r"reply of (\d+) bytes is above the unary threshold", str(exc))
    return int(found.group(1)) if found else None
