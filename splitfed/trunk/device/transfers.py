"""The cut's tensors in and out of the trunk's GPU with no host thread waiting on the device.

A trunk server on a GPU receives each client's activation or gradient in host
memory (a shared-memory region the server registered with CUDA, or the bytes of
a gRPC message) and answers with a tensor the trunk left on the device. Done
the plain way, each arrival is copied and checked on the host and each answer
is copied back with a synchronous ``tensor.cpu()``: the host work of every
client runs in series on the server's threads and the device thread stalls on
every copy. :class:`DeviceIO` instead

* copies each arrival host -> device on an *inbound* stream as soon as it is
  decoded (asynchronously from registered or pinned memory; from pageable
  bytes through a pinned buffer of a pool, on whatever thread calls it): an
  :class:`Arrival`;
* lets the device thread check a whole batch of arrivals for NaN/Inf with one
  fused reduction and one blocking read on the inbound stream
  (:meth:`DeviceIO.verdicts`), which waits for those copies only, never for the
  compute queued before them, and make its compute stream wait for them by
  event;
* copies each answer device -> host on an *outbound* stream that waits by event
  for the work that produced it, straight into the client's region or into a
  pinned pool buffer: a :class:`Departure`, whose event :class:`EventWaiter`
  waits on for the callers (one thread for all of them).

Pinned buffers are reused (pinning is slow: the CUDA call that allocates one
took 3 ms on an H100 host, per call). Pure torch; knows nothing of the channel.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from splitfed.codec.compression import dequantize_int8
from splitfed.codec.finite import is_finite
from splitfed.trunk.device.pinned import PinnedPool
from splitfed.trunk.compute.requests import Promise

log = logging.getLogger(__name__)

#: Pinned bytes lent at once to streamed requests gathering in place (:meth:`DeviceIO.host_buffer`).
MAX_GATHERING_BYTES = 1 << 30


@dataclass
class Arrival:
    """A tensor that came in a request, still in host memory (a shared-memory region, a pinned pool buffer or the
    request's own bytes), until the device thread brings it (:meth:`DeviceIO.bring`): the request carries
    :attr:`placeholder` until then."""

    name: str
    src: torch.Tensor  # the bytes (uint8, flat)
    dtype: torch.dtype
    shape: tuple[int, ...]
    guard: Callable[[], AbstractContextManager[Any]] | None = None  # held while a copy reads ``src``
    owned: bool = False  # ``src`` is the server's own, immutable memory (a request's bytes): no copy needed
    lease: torch.Tensor | None = None  # the pinned pool buffer ``src`` lies in
    tensor: torch.Tensor | None = None  # on the trunk's device, once brought
    #: For an int8 payload (``src`` one int8 per element): its fp32 scales' bytes, one per ``block_size``
    #: elements; the tensor is rebuilt in ``dtype`` where it is brought (on the GPU: half the bytes cross).
    scales: torch.Tensor | None = None
    block_size: int = 0

    @property
    def placeholder(self) -> torch.Tensor:
        """A tensor with the arrival's shape and dtype and no data (on the meta device)."""
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


@dataclass
class ReplySink:
    """Where a reply's tensor goes once the trunk computed it: into :attr:`dst` (host bytes the copy engine can
    write, a client's registered region slice) when it fits there, else into a pinned pool buffer; in
    :attr:`dtype` (None: the tensor's own)."""

    dtype: torch.dtype | None = None
    dst: torch.Tensor | None = None
    hold: Callable[[torch.cuda.Event], None] | None = None  # told the copy's event (the region waits for it)


@dataclass
class Departure:
    """A device tensor on its way to host memory: :attr:`host` holds it once :attr:`event` completed."""

    host: torch.Tensor
    event: torch.cuda.Event
    sink: ReplySink | None = None  # the sink it was sent to
    direct: bool = False  # :attr:`host` lies in the sink's ``dst``
    device: torch.Tensor | None = None  # the tensor on the device (a retried call's reply goes elsewhere)


def _as_uint8(src: torch.Tensor | memoryview | bytes) -> torch.Tensor:
    if isinstance(src, torch.Tensor):
        return src.reshape(-1).view(torch.uint8)
    return torch.frombuffer(src, dtype=torch.uint8) if len(src) else torch.empty(0, dtype=torch.uint8)


def _aligned(n: int) -> int:
    return -(-n // 64) * 64


class DeviceIO:
    """Copies at the cut for a trunk on ``device`` (see the module docstring). On the CPU there is no copy engine:
    :meth:`bring` copies what is not the server's own into memory of its own and checks it there."""

    def __init__(self, device: torch.device | str, pool: PinnedPool | None = None) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.pool = pool or PinnedPool()
        self.inbound = torch.cuda.Stream(self.device) if self.cuda else None
        self.outbound = torch.cuda.Stream(self.device) if self.cuda else None
        self._in_lock = threading.Lock()  # the inbound stream's work is issued in the order of this lock
        #: Bytes of streamed requests that may be gathering in pinned memory at once (see :meth:`host_buffer`).
        self.max_gathering = MAX_GATHERING_BYTES
        self._gathering = 0
        self._gathering_lock = threading.Lock()
        self.stats: dict[str, int] = {"in": 0, "in-staged": 0, "in-int8": 0, "brought": 0, "out": 0,
                                       "out-direct": 0, "out-packed": 0}

    # -- in ------------------------------------------------------------------------------------
    def stage(self, name: str, src: torch.Tensor | memoryview | bytes, dtype: torch.dtype, shape: Sequence[int], *,
              guard: Callable[[], AbstractContextManager[Any]] | None = None, owned: bool = False,
              scales: torch.Tensor | memoryview | bytes | None = None, block_size: int = 0,
              pinned: bool = False) -> Arrival:
        """An arrival of ``src`` (raw little-endian bytes of a ``dtype`` tensor of ``shape``).

        For a GPU, bytes in pageable memory are first copied into a pinned pool buffer, on the calling thread
        (numpy's copy, which releases the GIL), so that the copy engine can read them; registered or pinned
        ``src`` (a client's region) stays where it is, read under ``guard`` (the region stays mapped meanwhile).
        ``owned``: ``src`` is immutable memory of the server's own (a request's bytes). ``pinned``: the caller
        knows ``src`` to be pinned or registered with CUDA (a registered region), so CUDA is not asked (asking
        costs a driver call per arrival).

        ``scales``/``block_size``: ``src`` is a checked int8 payload (one int8 per element, one fp32 scale per
        ``block_size`` elements; see :func:`~splitfed.codec.compression.quantize_int8`) that :meth:`bring` rebuilds as
        a ``dtype`` tensor on the device.
        """
        flat = _as_uint8(src)
        extra = _as_uint8(scales) if scales is not None else None
        self.stats["in"] += 1
        if self.cuda and flat.numel() and not ((pinned and extra is None) or
                                               (flat.is_pinned() and (extra is None or extra.is_pinned()))):
            n, m = flat.numel(), 0 if extra is None else extra.numel()
            lease = self.pool.take(_aligned(n) + m)
            view = lease[:n]
            np.copyto(view.numpy(), flat.numpy())
            if extra is not None:
                np.copyto(lease[_aligned(n): _aligned(n) + m].numpy(), extra.numpy())
                extra = lease[_aligned(n): _aligned(n) + m]
            self.stats["in-staged"] += 1
            return Arrival(name, view, dtype, tuple(shape), owned=True, lease=lease, scales=extra,
                           block_size=block_size)
        return Arrival(name, flat, dtype, tuple(shape), guard=guard, owned=owned, scales=extra, block_size=block_size)

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of host memory as a writable array, for bytes the copy engine will read (a streamed request
        gathered in place as its chunks arrive, which :meth:`stage` then takes without a copy): a pinned pool
        buffer, back in the pool once nothing references the array or a view of its bytes. (Views must come by
        ``memoryview`` of the array itself: a numpy slice's views skip it for the array beneath.)

        At most :attr:`max_gathering` bytes are lent so at once (a stream declares its size before its bytes
        come, and page-locked memory is the host's to keep); beyond that the array is pageable memory, which
        :meth:`stage` copies into a pinned buffer once it is complete."""
        with self._gathering_lock:
            if self._gathering + nbytes > self.max_gathering:
                return np.empty(nbytes, dtype=np.uint8)
            self._gathering += nbytes
        lease = self.pool.take(nbytes)
        owner = lease.numpy()[:nbytes]
        weakref.finalize(owner, self._returned, lease, nbytes)
        return owner

    def _returned(self, lease: torch.Tensor, nbytes: int) -> None:
        with self._gathering_lock:
            self._gathering -= nbytes
        self.pool.give(lease)

    def bring(self, arrivals: Sequence[Arrival]) -> list[bool]:
        """Bring ``arrivals`` to the device (each gets its :attr:`Arrival.tensor`) and say which are free of
        NaN/Inf. Called by the thread that computes; returns once the copies are done.

        On a GPU: one allocation, every copy on the inbound stream, one fused reduction over all of them (the L2
        norm of each, which any NaN or Inf makes non-finite) and one read, which waits for these copies only,
        never for the compute queued before them. A finite tensor whose norm overflowed is then confirmed element
        by element.
        """
        if not arrivals:
            return []
        self.stats["brought"] += len(arrivals)
        if not self.cuda:
            return [self._bring_here(a) for a in arrivals]
        with contextlib.ExitStack() as guards:
            for a in arrivals:
                if a.guard is not None:
                    guards.enter_context(a.guard())
            rebuilt = []
            with self._in_lock, torch.cuda.stream(self.inbound):
                sizes = [(a.src.numel(), 0 if a.scales is None else a.scales.numel()) for a in arrivals]
                buf = torch.empty(sum(_aligned(n) + _aligned(m) for n, m in sizes), dtype=torch.uint8,
                                  device=self.device)
                at = 0
                for a, (n, m) in zip(arrivals, sizes):
                    piece = buf[at: at + n]
                    piece.copy_(a.src, non_blocking=True)
                    at += _aligned(n)
                    if a.scales is None:
                        a.tensor = piece.view(a.dtype).view(a.shape)
                        continue
                    scales = buf[at: at + m]
                    scales.copy_(a.scales, non_blocking=True)
                    at += _aligned(m)
                    a.tensor = dequantize_int8(piece.view(torch.int8), scales.view(torch.float32), a.block_size,
                                               a.shape, a.dtype)
                    rebuilt.append(a.tensor)
                    self.stats["in-int8"] += 1
                checked = [a for a in arrivals if a.dtype.is_floating_point and a.tensor.numel()]
                finite = iter(torch.stack(torch._foreach_norm([a.tensor for a in checked], 2, dtype=torch.float32))
                              .isfinite().cpu().tolist() if checked else [])  # the read: the copies are done
                verdicts = [bool(next(finite)) or bool(torch.isfinite(a.tensor).all())
                            if a.dtype.is_floating_point and a.tensor.numel() else True for a in arrivals]
            for used in [buf, *rebuilt]:  # the compute stream uses them from now on
                used.record_stream(torch.cuda.current_stream(self.device))
        for a in arrivals:
            if a.lease is not None:
                self.pool.give(a.lease)
                a.lease = None
        return verdicts

    @staticmethod
    def _bring_here(a: Arrival) -> bool:
        if a.scales is not None:
            a.tensor = dequantize_int8(a.src.view(torch.int8), a.scales.clone().view(torch.float32), a.block_size,
                                       a.shape, a.dtype)
        elif a.owned:
            a.tensor = a.src.view(a.dtype).view(a.shape)
        else:
            own = torch.empty(a.src.numel(), dtype=torch.uint8)
            with a.guard() if a.guard is not None else contextlib.nullcontext():
                np.copyto(own.numpy(), a.src.numpy())  # one thread; releases the GIL
            a.tensor = own.view(a.dtype).view(a.shape)
        return not a.dtype.is_floating_point or is_finite(a.tensor)

    # -- out -----------------------------------------------------------------------------------
    def to_host(self, tensor: torch.Tensor, dtype: torch.dtype | None = None, dst: torch.Tensor | None = None
                ) -> Departure:
        """``tensor`` (on the device; the work that makes it queued on the current stream) copied to host memory
        in ``dtype``: into ``dst`` (registered or pinned bytes, at least as large) or a pinned pool buffer, which
        goes back to the pool once the returned host tensor is no longer referenced."""
        dtype = dtype or tensor.dtype
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.device))
        nbytes = tensor.numel() * dtype.itemsize
        lease: torch.Tensor | None = None
        owner: np.ndarray | None = None
        if dst is None:
            lease = self.pool.take(nbytes)
            # The host tensor's storage holds this array (torch.from_numpy), and so does every view of it or of
            # its bytes: the buffer goes back to the pool only once nothing can read it any more.
            owner = lease.numpy()[:nbytes]
            dst = torch.from_numpy(owner)
        else:
            self.stats["out-direct"] += 1
        target = dst.reshape(-1)[:nbytes].view(dtype).view(tensor.shape)
        with torch.cuda.stream(self.outbound):
            self.outbound.wait_event(produced)
            src = tensor.detach()
            if src.dtype != dtype:
                src = src.to(dtype)
            target.copy_(src, non_blocking=True)
            tensor.record_stream(self.outbound)
            done = torch.cuda.Event()
            done.record(self.outbound)
        self.stats["out"] += 1
        if lease is not None:  # back in the pool once nothing reads the host tensor and the copy is done
            weakref.finalize(owner, self.pool.give, lease, done)
        return Departure(target, done)


def send(io: DeviceIO, items: Sequence[tuple[torch.Tensor, ReplySink]]) -> list[Departure]:
    """Copy each device tensor to its sink (see :class:`ReplySink`) by the copy engine, after the work queued so far
    on the current stream: one pair of events for all of them, no host waiting."""
    produced = torch.cuda.Event()
    produced.record(torch.cuda.current_stream(io.device))
    assert io.outbound is not None
    placed: list[tuple[torch.Tensor, bool, torch.Tensor | None, Any]] = []
    with torch.cuda.stream(io.outbound):
        io.outbound.wait_event(produced)
        for tensor, sink in items:
            dtype = sink.dtype or tensor.dtype
            nbytes = tensor.numel() * dtype.itemsize
            lease = owner = None
            direct = sink.dst is not None and nbytes <= sink.dst.numel()
            if direct:
                dst = sink.dst
                io.stats["out-direct"] += 1
            else:
                lease = io.pool.take(nbytes)
                owner = lease.numpy()[:nbytes]  # see DeviceIO.to_host: the buffer lives as long as its bytes
                dst = torch.from_numpy(owner)
            target = dst.reshape(-1)[:nbytes].view(dtype).view(tensor.shape)
            src = tensor.detach()
            target.copy_(src if src.dtype == dtype else src.to(dtype), non_blocking=True)
            tensor.record_stream(io.outbound)
            placed.append((target, direct, lease, owner))
        done = torch.cuda.Event()
        done.record(io.outbound)
    io.stats["out"] += len(items)
    out = []
    for (tensor, sink), (target, direct, lease, owner) in zip(items, placed):
        if lease is not None:
            weakref.finalize(owner, io.pool.give, lease, done)
        if direct and sink.hold is not None:
            sink.hold(done)
        out.append(Departure(target, done, sink, direct, tensor))
    return out


class EventWaiter:
    """One thread that waits for CUDA events in turn and then completes their futures."""

    def __init__(self, name: str = "splitfed-trunk-events") -> None:
        self._queue: queue.SimpleQueue[tuple[torch.cuda.Event, Future[Any], Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def when_done(self, event: torch.cuda.Event, value: Any = None) -> Future[Any]:
        """A future that holds ``value`` once ``event`` completed (at once if it already has)."""
        future: Future[Any] = Promise()
        if event.query():
            future.set_result(value)
        else:
            self._queue.put((event, future, value))
        return future

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, future, value = item
            try:
                event.synchronize()
            except BaseException as exc:  # noqa: BLE001 - a device fault reaches the caller
                future.set_exception(exc)
            else:
                future.set_result(value)

    def stop(self) -> None:
        """End the thread once the events queued so far completed."""
        self._queue.put(None)
        self._thread.join(10)
