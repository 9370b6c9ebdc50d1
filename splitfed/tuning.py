"""Process-level tuning for moving large tensors: keep big buffers in glibc's heap.

glibc serves allocations above ``M_MMAP_THRESHOLD`` with fresh ``mmap`` pages
and returns them on free, so every multi-MiB message buffer pays page faults
again (about 10x the cost of the copy itself on virtual machines). Raising the
mmap and trim thresholds lets those buffers be reused. Applied once per process
by the trunk server and client; set ``SPLITFED_TUNE_MALLOC=0`` to leave malloc
alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
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
