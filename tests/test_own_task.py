"""A call's work in a task of its own, started eagerly (``splitfed.channel.engine.loop.own_task`` and
``own_work``): what never suspends ends at once; what suspends carries on in a task that behaves as one created
for it."""

from __future__ import annotations

import asyncio
import sys

import pytest

from splitfed.channel.engine.loop import _started, own_task, own_work


@pytest.fixture(params=["own_task", "own_work", "started"])
def start(request: pytest.FixtureRequest):
    """``own_task`` and ``own_work`` as this Python runs them, and the eager start that ``own_work`` uses on
    Python 3.11 (tested on every Python)."""
    return {"own_task": own_task, "own_work": own_work, "started": _started}[request.param]


def test_work_that_never_suspends_ends_at_once(start) -> None:
    if start is own_task and sys.version_info < (3, 12):
        pytest.skip("own_task starts eagerly from Python 3.12 on")
    ran: list[str] = []

    async def work(value: int) -> int:
        ran.append("ran")
        return value * 2

    async def main() -> None:
        future = start(work(21))
        assert ran == ["ran"]  # before the loop turned
        assert future.done() and await future == 42

    asyncio.run(main())


def test_an_error_before_any_suspension_is_the_futures_outcome(start) -> None:
    async def work() -> None:
        raise ValueError("bad input")

    async def main() -> None:
        future = start(work())
        with pytest.raises(ValueError, match="bad input"):
            await future

    asyncio.run(main())


def test_work_that_suspends_carries_on_and_answers(start) -> None:
    async def work(gate: asyncio.Future[int]) -> int:
        first = await gate
        await asyncio.sleep(0)
        second = await asyncio.sleep(0.01, result=5)
        return first + second

    async def main() -> None:
        loop = asyncio.get_running_loop()
        gate: asyncio.Future[int] = loop.create_future()
        future = start(work(gate))
        assert not future.done()
        loop.call_later(0.01, gate.set_result, 10)
        assert await future == 15

    asyncio.run(main())


def test_cancelling_the_task_reaches_the_work_where_it_waits(start) -> None:
    seen: list[str] = []

    async def work(gate: asyncio.Future[None]) -> str:
        try:
            await gate
        except asyncio.CancelledError:
            seen.append("cancelled")
            await asyncio.sleep(0)  # it may still clean up, then end as it chooses
            return "cleaned up"
        return "not cancelled"

    async def main() -> None:
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task = start(work(gate))
        await asyncio.sleep(0.01)
        task.cancel()
        assert await task == "cleaned up"
        assert seen == ["cancelled"] and gate.cancelled()

    asyncio.run(main())


def test_a_shielded_awaiter_cancelled_leaves_the_work_running(start) -> None:
    async def work(gate: asyncio.Future[int]) -> int:
        return await gate + 1

    async def caller(gate: asyncio.Future[int], box: list) -> int:
        box.append(start(work(gate)))
        return await asyncio.shield(box[0])

    async def main() -> None:
        loop = asyncio.get_running_loop()
        gate: asyncio.Future[int] = loop.create_future()
        box: list = []
        call = asyncio.ensure_future(caller(gate, box))
        await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        gate.set_result(1)
        assert await box[0] == 2  # the work went on

    asyncio.run(main())


def test_a_cancellation_reaches_the_work_even_when_what_it_awaits_is_done(start) -> None:
    async def work(gate: asyncio.Future[int]) -> str:
        try:
            await gate
        except asyncio.CancelledError:
            return "cancelled"
        return "went on"

    async def main() -> None:
        gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        task = start(work(gate))
        await asyncio.sleep(0)
        gate.set_result(1)
        task.cancel()  # the gate is done: the task throws the cancellation in at its next step
        assert await task == "cancelled"

    asyncio.run(main())
