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

Freezing alone leaves the collector's schedule as it is: a collection of the youngest objects every 700 net
allocations, a full one every 100 of those. A serving engine allocates fast (on an H100 with 32 clients, some
150 young collections a second), so full collections came about once a second, and each still walked everything
allocated since the start: 33-84 ms with nothing collected, every client's step held meanwhile. While the heap is
frozen the collector therefore runs less often (:data:`SERVING_THRESHOLDS`; ``gc.set_threshold``): young
collections about 70 times less often, full ones about 5,000 times less often. Objects that die by their
reference count are freed at once as ever; only garbage in reference cycles waits longer. The thresholds are
restored with the thaw. ``SPLITFED_GC_THRESHOLDS="a,b,c"`` sets others, ``SPLITFED_GC_THRESHOLDS=default``
keeps Python's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import threading

from splitfed.errors import ConfigError

log = logging.getLogger(__name__)

#: The collector's thresholds (``gc.set_threshold``) while the heap is frozen: young, middle, full.
SERVING_THRESHOLDS = (50_000, 20, 100)
_saved_thresholds: list[tuple[int, ...]] = []  # Python's, while a freeze has the serving ones in force

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
    thresholds = serving_thresholds()
    gc.collect()  # what is garbage now is freed, not frozen
    gc.freeze()
    if thresholds is not None:
        if not _saved_thresholds:
            _saved_thresholds.append(gc.get_threshold())
        gc.set_threshold(*thresholds)
    log.debug("froze %d objects out of the garbage collector's reach; collector thresholds %s",
              gc.get_freeze_count(), gc.get_threshold())
    return True


def serving_thresholds() -> tuple[int, int, int] | None:
    """The collector's thresholds while serving: ``SPLITFED_GC_THRESHOLDS`` ("a,b,c"; "default": None, Python's
    own kept), else :data:`SERVING_THRESHOLDS`."""
    raw = os.environ.get("SPLITFED_GC_THRESHOLDS", "").strip()
    if not raw:
        return SERVING_THRESHOLDS
    if raw == "default":
        return None
    try:
        values = tuple(int(v) for v in raw.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) < 1:
        raise ConfigError(f"SPLITFED_GC_THRESHOLDS={raw!r}: give three positive integers, such as "
                          f"{','.join(map(str, SERVING_THRESHOLDS))}, or 'default' for Python's own")
    return values[0], values[1], values[2]


def thaw_heap() -> None:
    """Give every frozen object back to the collector (``gc.unfreeze``), and its thresholds back to what they were:
    a stopped server's own objects, frozen while it served, are then collected like any other once nothing holds
    them."""
    gc.unfreeze()
    if _saved_thresholds:
        gc.set_threshold(*_saved_thresholds.pop())


def collect_all() -> None:
    """A full collection over frozen objects too (after a model was unloaded, its reference cycles may lie among
    them), then freeze what is left again where it was frozen."""
    frozen = gc.get_freeze_count() > 0
    if frozen:
        gc.unfreeze()
    gc.collect()
    if frozen:
        gc.freeze()
