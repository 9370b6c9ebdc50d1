"""How a serving command lives: until SIGTERM or SIGINT (or its server stops by itself), then it stops.

The signal handlers only set a flag; the stop itself runs on the main thread in plain code, not inside a handler
that interrupted the main thread wherever it stood (in a wait, holding a lock). From the command's start,
``SIGUSR1`` writes every thread's stack to stderr (:mod:`faulthandler`): what a server that does not answer is
doing, without stopping it.
"""

from __future__ import annotations

import faulthandler
import io
import logging
import signal
import sys
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

#: How often the main thread looks whether the server stopped by itself (seconds).
POLL_S = 0.2


def stacks_on_sigusr1() -> None:
    """From now on, ``SIGUSR1`` writes every thread's stack to stderr and the process goes on (where the platform
    has the signal and stderr is a file)."""
    if not hasattr(signal, "SIGUSR1"):
        return
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, io.UnsupportedOperation):  # stderr is no file (the command run in-process)
        log.debug("SIGUSR1 writes no stacks: stderr has no file descriptor")


def serve_until_signalled(wait: Callable[[float], bool], stop: Callable[[], None]) -> int:
    """Block until SIGTERM or SIGINT arrives, or until ``wait(timeout)`` (True while still serving after
    ``timeout`` seconds) says the server stopped; then call ``stop()`` on this thread. Returns 0."""
    stopping = threading.Event()

    def on_signal(*_: object) -> None:
        stopping.set()

    handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stopping.is_set() and wait(POLL_S):
            pass
    finally:
        stop()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return 0


__all__ = ["POLL_S", "serve_until_signalled", "stacks_on_sigusr1"]
