"""The event loop awaits what the trunk's device thread settles (``splitfed.channel.engine.loop.awaiting``): the
outcome crosses threads, and a call that gives up stops waiting without cancelling the shared work."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any

import pytest

from splitfed.channel.engine.loop import awaiting, mailbox_of


def _settle_later(future: concurrent.futures.Future[int], *, value: int | None = None,
                  error: Exception | None = None, after: float = 0.05) -> threading.Thread:
    def run() -> None:
        time.sleep(after)
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_result_and_an_error_cross_from_another_thread() -> None:
    async def main() -> None:
        ok: concurrent.futures.Future[int] = concurrent.futures.Future()
        bad: concurrent.futures.Future[int] = concurrent.futures.Future()
        threads = [_settle_later(ok, value=7), _settle_later(bad, error=ValueError("no"))]
        assert await awaiting(ok) == 7
        with pytest.raises(ValueError, match="no"):
            await awaiting(bad)
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        done.set_result(3)
        assert await awaiting(done) == 3  # already settled: no other thread involved
        for t in threads:
            t.join()
    asyncio.run(main())


def test_a_call_that_gives_up_leaves_the_work_to_the_others() -> None:
    """Two calls wait for one piece of work; one is cancelled. The work is not cancelled, the device thread that
    settles it later raises nothing, and the other call gets the result."""
    errors: list[BaseException] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx.get("exception")))
        work: concurrent.futures.Future[int] = concurrent.futures.Future()
        gives_up = asyncio.ensure_future(awaiting(work))
        stays = asyncio.ensure_future(awaiting(work))
        await asyncio.sleep(0.01)
        gives_up.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gives_up
        assert not work.cancelled() and not work.done()

        def settle() -> None:
            try:
                work.set_result(5)
            except BaseException as exc:  # noqa: BLE001 - what the device thread would die of
                errors.append(exc)
        thread = threading.Thread(target=settle)
        thread.start()
        assert await stays == 5
        thread.join()
        await asyncio.sleep(0.01)  # the cancelled waiter's settle ran: nothing raised on the loop
    asyncio.run(main())
    assert errors == []


def test_many_waiters_under_load() -> None:
    """200 calls, each waiting for work settled by a pool of threads, every fourth cancelled: the others get
    their own result, and nothing fails on the loop."""
    errors: list[Any] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
        pool = concurrent.futures.ThreadPoolExecutor(4)
        go = threading.Event()  # no work ends before the cancellations

        def work(i: int) -> int:
            go.wait(10)
            time.sleep(0.001 * (i % 5))
            return i
        try:
            futures = [pool.submit(work, i) for i in range(200)]
            waiters = [awaiting(f) for f in futures]
            for w in waiters[::4]:
                w.cancel()
            go.set()
            results = await asyncio.gather(*waiters, return_exceptions=True)
        finally:
            go.set()
            pool.shutdown()
        for i, r in enumerate(results):
            if i % 4 == 0:
                assert isinstance(r, asyncio.CancelledError)
            else:
                assert r == i
        assert all(not f.cancelled() for f in futures)
        await asyncio.sleep(0.05)  # the cancelled waiters' settles ran
    asyncio.run(main())
    assert errors == []


def test_a_burst_of_posts_wakes_the_loop_once_and_runs_in_order() -> None:
    """While the loop is busy, another thread posts 50 callbacks: one wake-up of the loop carries them all, and
    they run in the order posted."""
    ran: list[int] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        box = mailbox_of(loop)
        assert mailbox_of(loop) is box
        busy, posted = threading.Event(), threading.Event()

        def poster() -> None:
            busy.wait()
            for i in range(50):
                box.post(ran.append, i)
            posted.set()
        thread = threading.Thread(target=poster)
        thread.start()
        loop.call_soon(lambda: (busy.set(), posted.wait(10)))  # holds the loop while the burst is posted
        while len(ran) < 50:
            await asyncio.sleep(0.001)
        thread.join()
        assert box.wakeups == 1
    asyncio.run(main())
    assert ran == list(range(50))


def test_posts_from_many_threads_each_run_once_and_a_failing_one_stops_nothing() -> None:
    """8 threads post 500 callbacks each while the loop runs: every callback runs once, each thread's in its own
    order; one that raises is reported to the loop's exception handler and the rest still run."""
    ran: dict[int, list[int]] = {t: [] for t in range(8)}
    errors: list[Any] = []

    def boom() -> None:
        raise RuntimeError("posted callback failed")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx.get("exception")))
        box = mailbox_of(loop)

        def poster(t: int) -> None:
            for i in range(500):
                box.post(ran[t].append, i)
                if t == 0 and i == 250:
                    box.post(boom)
        threads = [threading.Thread(target=poster, args=(t,)) for t in range(8)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while sum(len(v) for v in ran.values()) < 4000 and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        for thread in threads:
            thread.join()
        await asyncio.sleep(0.01)
    asyncio.run(main())
    assert all(v == list(range(500)) for v in ran.values())
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)


def test_a_post_to_a_closed_loop_is_dropped() -> None:
    loop = asyncio.new_event_loop()
    box = mailbox_of(loop)
    loop.close()
    ran: list[int] = []
    box.post(ran.append, 1)  # nobody waits on a closed loop: no error, nothing run
    box.post(ran.append, 2)
    assert ran == [] and box.wakeups == 2


def test_a_loop_and_its_mailbox_are_collected_once_the_loop_is_gone() -> None:
    """The mailboxes are kept per loop, weakly: a closed loop that nobody holds goes away with its mailbox (a
    server started and stopped many times, or ``asyncio.run`` per call, leaks nothing)."""
    import gc
    import weakref

    from splitfed.channel.engine import loop as loopthread

    loop = asyncio.new_event_loop()
    box = weakref.ref(mailbox_of(loop))
    gone = weakref.ref(loop)
    loop.close()
    del loop
    gc.collect()
    assert gone() is None and box() is None
    assert all(alive is not None for alive in loopthread._MAILBOXES.keys())
