"""An asyncio event loop run on a thread of its own, as the trunk server and the router run theirs."""

from __future__ import annotations

import asyncio
import threading


def stop_loop(loop: asyncio.AbstractEventLoop | None, thread: threading.Thread | None) -> None:
    """Stop ``loop`` (running forever on ``thread``), wait up to 5 s for the thread, and close the loop once it
    no longer runs."""
    if loop is None or thread is None:
        return
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    if not loop.is_running():
        loop.close()
