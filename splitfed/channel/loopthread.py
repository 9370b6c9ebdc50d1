"""An asyncio event loop run on a thread of its own, as the trunk server and the router run theirs, and how that
loop awaits what other threads (the trunk's device thread) settle."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import TypeVar

T = TypeVar("T")


def stop_loop(loop: asyncio.AbstractEventLoop | None, thread: threading.Thread | None) -> None:
    """Stop ``loop`` (running forever on ``thread``), wait up to 5 s for the thread, and close the loop once it
    no longer runs."""
    if loop is None or thread is None:
        return
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    if not loop.is_running():
        loop.close()


def awaiting(future: concurrent.futures.Future[T]) -> asyncio.Future[T]:
    """An asyncio future, on the running loop, that takes ``future``'s outcome once another thread settles it.

    Cancelling it (its call was cancelled: the client died or gave up) leaves ``future`` alone, so the work and
    the step it belongs to go on for the others; nothing is set on a cancelled waiter. This is
    ``asyncio.shield(asyncio.wrap_future(future))`` with one asyncio future and one callback instead of three
    and four, on every trunk call's path.
    """
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[T] = loop.create_future()
    if future.done():
        _settle(future, waiter)
        return waiter

    def done(settled: concurrent.futures.Future[T]) -> None:
        if loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(_settle, settled, waiter)
        except RuntimeError:  # the loop closed meanwhile: nobody waits any more
            pass

    future.add_done_callback(done)
    return waiter


def _settle(source: concurrent.futures.Future[T], waiter: asyncio.Future[T]) -> None:
    if waiter.done():  # cancelled while the work ran
        return
    if source.cancelled():
        waiter.cancel()
        return
    error = source.exception()
    if error is not None:
        waiter.set_exception(error)
    else:
        waiter.set_result(source.result())
