"""How many times the host reads the GPU back in a piece of work (a split step, an unsplit step).

A read of a device tensor by the host (``.item()``, ``bool(t)``, a ``.cpu()`` that must wait) drains the GPU's
queue: the GPU idles while the host that waited queues more work. :func:`count_host_syncs` runs a function under
``torch.cuda.set_sync_debug_mode("warn")``, which has PyTorch warn at every such read, on any thread of this
process, and counts the warnings; :func:`where_host_syncs` also says where each came from (the Python stack of
the thread that waited), and :class:`HostSyncs` counts between a start and a stop (``bench.trunk --timeline``: the
engine's reads over the timed steps). Explicit ``torch.cuda.synchronize()`` calls are not counted, and reads in
other processes (a trunk server in a process of its own) are not seen. PyTorch calls the mode a prototype that
does not catch every synchronizing operation, so the count is a floor. Without CUDA nothing is counted.
"""

from __future__ import annotations

import collections
import threading
import traceback
import warnings
from collections.abc import Callable

import torch

#: The text of PyTorch's warning at a synchronizing operation.
SYNC_WARNING = "called a synchronizing CUDA operation"


class HostSyncs:
    """Counts the host's reads of the GPU from :meth:`start` to :meth:`stop`, on every thread of this process, by
    where they came from (a stack of ``frames``); does nothing without CUDA."""

    def __init__(self, frames: int = 12) -> None:
        self.frames = frames
        self.found: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._saved: tuple[object, object, int] | None = None

    def _show(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
              file: object = None, line: str | None = None) -> None:
        if SYNC_WARNING not in str(message):
            assert self._saved is not None
            self._saved[1](message, category, filename, lineno, file, line)  # type: ignore[operator]
            return
        stack = "".join(traceback.format_stack(limit=self.frames)[:-2])
        with self._lock:
            self.found[stack] += 1

    def start(self) -> HostSyncs:
        """Begin counting (the work queued so far is waited for first, so that it is not counted)."""
        if torch.cuda.is_available() and self._saved is None:
            torch.cuda.synchronize()
            saved = warnings.catch_warnings()  # restores the filters and showwarning at stop
            saved.__enter__()
            self._saved = (saved, warnings.showwarning, torch.cuda.get_sync_debug_mode())
            warnings.simplefilter("always")
            warnings.showwarning = self._show
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def stop(self) -> int:
        """Stop counting; the reads counted."""
        if self._saved is not None:
            saved, _, mode = self._saved
            torch.cuda.set_sync_debug_mode(mode)  # type: ignore[arg-type]
            saved.__exit__(None, None, None)  # type: ignore[attr-defined]
            self._saved = None
        return sum(self.found.values())


def where_host_syncs(fn: Callable[[], object], frames: int = 12) -> collections.Counter[str]:
    """Run ``fn`` once and count the host's reads of the GPU by where they came from (a stack of ``frames``)."""
    syncs = HostSyncs(frames).start()
    try:
        fn()
    finally:
        syncs.stop()
    return syncs.found


def count_host_syncs(fn: Callable[[], object]) -> int:
    """Run ``fn`` once; the host's reads of the GPU it made (0 without CUDA)."""
    return sum(where_host_syncs(fn).values())
