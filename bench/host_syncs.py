"""How many times the host reads the GPU back in a piece of work (a split step, an unsplit step).

A read of a device tensor by the host (``.item()``, ``bool(t)``, a ``.cpu()`` that must wait) drains the GPU's
queue: the GPU idles while the host that waited queues more work. :func:`count_host_syncs` runs a function under
``torch.cuda.set_sync_debug_mode("warn")``, which has PyTorch warn at every such read, on any thread of this
process, and counts the warnings; with :func:`where_host_syncs` it also says where each came from (the Python
stack of the thread that waited). Explicit ``torch.cuda.synchronize()`` calls are not counted, and reads in other
processes (a trunk server in a process of its own) are not seen. PyTorch calls the mode a prototype that does not
catch every synchronizing operation, so the count is a floor. Without CUDA both give nothing.
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


def where_host_syncs(fn: Callable[[], object], frames: int = 12) -> collections.Counter[str]:
    """Run ``fn`` once and count the host's reads of the GPU by where they came from (a stack of ``frames``)."""
    found: collections.Counter[str] = collections.Counter()
    if not torch.cuda.is_available():
        fn()
        return found
    lock = threading.Lock()
    shown = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: object = None,
             line: str | None = None) -> None:
        if SYNC_WARNING not in str(message):
            shown(message, category, filename, lineno, file, line)  # type: ignore[arg-type]
            return
        stack = "".join(traceback.format_stack(limit=frames)[:-2])
        with lock:
            found[stack] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return found


def count_host_syncs(fn: Callable[[], object]) -> int:
    """Run ``fn`` once; the host's reads of the GPU it made (0 without CUDA)."""
    return sum(where_host_syncs(fn).values())
