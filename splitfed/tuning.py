"""Process-level tuning for serving: big buffers kept in glibc's heap, and the start-up heap out of the garbage
collector's way.

glibc serves allocations above ``M_MMAP_THRESHOLD`` with fresh ``mmap`` pages
and returns them on free, so every multi-MiB message buffer pays page faults
again (about 10x the cost of the copy itself on virtual machines). Raising the
mmap and trim thresholds lets those buffers be reused. Applied once per process
by the trunk server and client; set ``SPLITFED_TUNE_MALLOC=0`` to leave malloc
alone.

A process that imported torch and transformers holds some 340,000 objects that live as long as it does, and
each of Python's full (generation 2) collections walks all of them: 100-200 ms during which no thread of the
process runs Python. In a trunk server such a pause stalls every client's sync step; on an H100 one call in a
step was held that long in about one step in ten. :func:`freeze_heap` moves what is alive once a server has
started out of the collector's reach (``gc.freeze``), so later collections walk only what the server allocates
while serving, and gives them back when it stops (:func:`thaw_heap`). The trunk server's engine and front-end
processes do so; ``SPLITFED_FREEZE_HEAP=0`` leaves the collector alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import threading

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = threading.Event()


def tune_malloc(mmap_threshold: int = 256 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Raise glibc's mmap and trim thresholds; returns whether they were set (False off glibc)."""
    if _done.is_set() or os.environ.get("SPLITFED_TUNE_MALLOC", "1") == "0":
        return False
    _done.set()
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))
    log.debug("malloc thresholds raised: %s", ok)
    return ok


def freeze_heap() -> bool:
    """Collect once, then freeze every object still alive (``gc.freeze``): later collections skip them. Returns
    whether it froze (not with ``SPLITFED_FREEZE_HEAP=0``)."""
    if os.environ.get("SPLITFED_FREEZE_HEAP", "1") == "0":
        return False
    gc.collect()  # what is garbage now is freed, not frozen
    gc.freeze()
    log.debug("froze %d objects out of the garbage collector's reach", gc.get_freeze_count())
    return True


def thaw_heap() -> None:
    """Give every frozen object back to the collector (``gc.unfreeze``): a stopped server's own objects, frozen
    while it served, are then collected like any other once nothing holds them."""
    gc.unfreeze()


def collect_all() -> None:
    """A full collection over frozen objects too (after a model was unloaded, its reference cycles may lie among
    them), then freeze what is left again where it was frozen."""
    frozen = gc.get_freeze_count() > 0
    if frozen:
        gc.unfreeze()
    gc.collect()
    if frozen:
        gc.freeze()
