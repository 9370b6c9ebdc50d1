"""GPU memory that a client on the trunk's host maps too (CUDA IPC): a region's twin on the trunk's GPU.

When client and trunk compute on one GPU, copying the cut's tensors through a
host region crosses PCIe twice each way. The trunk server then also gives each
region a block of device memory of the same size (:class:`DeviceMemory`); the
client maps it by its IPC handle, and event-ordered slices live there: a copy
at the cut is a device-to-device copy.

Each block is its own ``cudaMalloc`` allocation, outside torch's caching
allocator: an IPC handle maps the whole allocation it names, and a block carved
out of the caching allocator's segments would hand the client whatever else
lies in that segment. The CUDA runtime is the one torch loaded, called through
``ctypes``; without it (or without a GPU) no block is made and the host region
carries everything, as before.

Pure torch and the standard library; knows nothing of gRPC.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch

from splitfed.errors import CodecError, SharedMemoryUnavailableError

log = logging.getLogger(__name__)

_IPC_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


_runtime: Any = None
_runtime_lock = threading.Lock()
_LOCAL: dict[str, DeviceMemory] = {}  # by region name: a client in the server's process uses the block itself


def _cudart() -> Any:
    """The CUDA runtime library torch uses (None when it cannot be found)."""
    global _runtime
    with _runtime_lock:
        if _runtime is not None:
            return _runtime or None
        _runtime = False
        if not torch.cuda.is_available():
            return None
        torch.cuda.init()
        path = None
        try:
            with open("/proc/self/maps") as maps:
                path = next((line.split()[-1] for line in maps if "libcudart.so" in line), None)
        except OSError:
            path = None
        try:
            lib = ctypes.CDLL(path or "libcudart.so")
        except OSError:
            log.info("no CUDA runtime library found: GPU copies at the cut go through host memory")
            return None
        lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        lib.cudaFree.argtypes = [ctypes.c_void_p]
        lib.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_void_p]
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcHandle, ctypes.c_uint]
        lib.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        for fn in (lib.cudaMalloc, lib.cudaFree, lib.cudaIpcGetMemHandle, lib.cudaIpcOpenMemHandle,
                   lib.cudaIpcCloseMemHandle):
            fn.restype = ctypes.c_int
        _runtime = lib
        return lib


def available() -> bool:
    """Whether this process can make and map blocks (a GPU and the CUDA runtime)."""
    return _cudart() is not None


class _Block:
    """Owns one allocation (``cudaFree``) or one mapping (``cudaIpcCloseMemHandle``), released when the last tensor
    viewing it goes; exposes it to torch through ``__cuda_array_interface__``."""

    def __init__(self, ptr: int, nbytes: int, device: int, owner: bool) -> None:
        self.ptr, self.nbytes, self.device, self.owner = ptr, nbytes, device, owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 2, "strides": None}

    def __del__(self) -> None:
        lib = _runtime
        if not lib:
            return
        try:
            with torch.cuda.device(self.device):
                (lib.cudaFree if self.owner else lib.cudaIpcCloseMemHandle)(ctypes.c_void_p(self.ptr))
        except Exception:  # interpreter shutdown: the driver releases everything anyway
            pass


class DeviceMemory:
    """A block of ``nbytes`` on CUDA device ``device``: made by the trunk server (:meth:`allocate`) or mapped by
    its client (:meth:`open`). :meth:`view` gives bounds-checked byte slices as CUDA tensors."""

    def __init__(self, tensor: torch.Tensor, device: int) -> None:
        self.nbytes = int(tensor.numel())
        self.device = device
        self._handle = b""
        #: The whole block as a uint8 CUDA tensor (it holds the block: the allocation goes with the last view).
        self.bytes = tensor

    @classmethod
    def _of(cls, block: _Block) -> DeviceMemory:
        return cls(torch.as_tensor(block, device=torch.device("cuda", block.device)), block.device)

    @classmethod
    def allocate(cls, nbytes: int, device: int, name: str = "") -> DeviceMemory:
        """A new block (the server's side); registered under region ``name`` for a client in this process."""
        lib = _cudart()
        if lib is None:
            raise SharedMemoryUnavailableError("no CUDA runtime to allocate shareable GPU memory")
        ptr, handle = ctypes.c_void_p(), _IpcHandle()
        with torch.cuda.device(device):
            err = lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
            if err or not ptr.value:
                raise SharedMemoryUnavailableError(f"cudaMalloc of {nbytes} bytes failed (error {err})")
            block = _Block(ptr.value, nbytes, device, owner=True)
            err = lib.cudaIpcGetMemHandle(ctypes.byref(handle), ptr)
            if err:
                raise SharedMemoryUnavailableError(f"cudaIpcGetMemHandle failed (error {err})")
        memory = cls._of(block)
        memory._handle = bytes(handle)  # the raw 64 bytes (the field would stop at the first NUL)
        if name:
            _LOCAL[name] = memory
        return memory

    @classmethod
    def open(cls, handle: bytes, nbytes: int, device: int) -> DeviceMemory:
        """The server's block from its IPC handle (a client in another process, on the same GPU: ``device`` is
        this process's index of it)."""
        lib = _cudart()
        if lib is None:
            raise SharedMemoryUnavailableError("no CUDA runtime to map the trunk server's GPU memory")
        if len(handle) != HANDLE_BYTES:
            raise SharedMemoryUnavailableError(f"a CUDA IPC handle has {HANDLE_BYTES} bytes, got {len(handle)}")
        ptr = ctypes.c_void_p()
        with torch.cuda.device(device):
            err = lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), _IpcHandle.from_buffer_copy(handle),
                                           _IPC_LAZY_ENABLE_PEER_ACCESS)
        if err or not ptr.value:
            raise SharedMemoryUnavailableError(f"cannot map the trunk server's GPU memory (CUDA error {err})")
        return cls._of(_Block(ptr.value, nbytes, device, owner=False))

    def handle(self) -> bytes:
        """The block's IPC handle (the server's side)."""
        return self._handle

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` from ``offset`` as a uint8 CUDA tensor; raises :class:`CodecError` past the block's end."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise CodecError(f"slice [{offset}, {offset + nbytes}) lies outside the region's GPU memory of "
                             f"{self.nbytes} bytes")
        return self.bytes[offset:offset + nbytes]

    def close(self) -> None:
        """Drop this side's reference (the block goes with the last tensor viewing it)."""
        self.bytes = torch.empty(0, dtype=torch.uint8)


# -- lifetime ---------------------------------------------------------------------------------------
# Freeing memory that another process still maps is undefined behaviour in CUDA: the address may come back from
# a later allocation while that process writes there. So the server frees a region's block only once its client
# closed the region (it unmaps first) or its process is gone; until then a retired block waits here.
_PARKED: dict[str, tuple[DeviceMemory, int, str, str]] = {}  # name -> (block, pid, start, owner)
_parked_lock = threading.Lock()


def process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot; None when no such process is visible here): with
    the pid, it tells the same process from a later one that got the pid again."""
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def may_map(pid: int) -> bool:
    """Whether a client that says it is process ``pid`` may get a block: a process of this user that this server
    sees (so its end can be noticed)."""
    if pid <= 0:
        return False
    try:
        return os.stat(f"/proc/{int(pid)}").st_uid == os.getuid() and process_start(pid) is not None
    except OSError:
        return False


def retire(name: str, memory: DeviceMemory, owner: str, pid: int, start: str | None, released: bool = False
           ) -> None:
    """The server lets go of region ``name``'s block (client ``owner``, process ``pid`` started at ``start``):
    freed now when the client released it (closed the region), runs in this process (it holds a reference of its
    own) or is gone; else kept until its process is gone."""
    sweep()
    _LOCAL.pop(name, None)
    if released or pid == os.getpid() or start is None or process_start(pid) != start:
        memory.close()
        return
    with _parked_lock:
        _PARKED[name] = (memory, pid, start, owner)


def release(name: str, owner: str) -> None:
    """Free a kept block whose client closed its region since (only its own client may)."""
    with _parked_lock:
        entry = _PARKED.get(name)
        if entry is None or entry[3] != owner:
            return
        del _PARKED[name]
    entry[0].close()


def sweep() -> None:
    """Free the kept blocks whose client process is gone."""
    with _parked_lock:
        gone = [name for name, (_, pid, start, _) in _PARKED.items() if process_start(pid) != start]
        freed = [_PARKED.pop(name)[0] for name in gone]
    for memory in freed:
        memory.close()


def parked_bytes(owner: str | None = None) -> int:
    """Bytes of blocks kept for clients that still run (of client ``owner`` only, when given)."""
    sweep()
    with _parked_lock:
        return sum(entry[0].nbytes for entry in _PARKED.values() if owner is None or entry[3] == owner)


def local_memory(name: str) -> DeviceMemory | None:
    """The GPU memory of region ``name`` when its server runs in this process (a reference of the client's own:
    the server closing its side leaves the client's views valid until the client lets go)."""
    memory = _LOCAL.get(name)
    return None if memory is None else DeviceMemory(memory.bytes, memory.device)
