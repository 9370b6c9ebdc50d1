"""A call's work in a task of its own, started eagerly (``splitfed.channel.engine.loop.own_task`` and
``own_work``): what never suspends ends at once; what suspends carries on in a task that behaves as one created
for it."""

from __future__ import annotations

import asyncio
import sys

import pytest

from splitfed.channel.engine.loop import _DETACHED, _started, detach, own_task, own_work, shielded_work


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


# -- shielded_work: the call's future, settled by the work itself ---------------------------------------------------
def test_shielded_work_answers_its_outcome_and_ends_at_once_when_it_never_suspends() -> None:
    async def never_suspends() -> int:
        return 7

    async def fails(gate: asyncio.Future[int]) -> int:
        await gate
        raise ValueError("bad input")

    async def main() -> None:
        outcome, work = shielded_work(never_suspends())
        assert outcome.done() and await outcome == 7 and work.done()
        gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        outcome, work = shielded_work(fails(gate))
        gate.set_result(1)
        with pytest.raises(ValueError, match="bad input"):
            await outcome
        await work  # the work's task ends cleanly: its error is the caller's, not a task's never read

    asyncio.run(main())


def test_the_outcome_is_settled_within_the_works_own_step() -> None:
    """The caller wakes one turn of the loop after the work's last wait ends (a shield takes two): what the
    shielded wrapper saves per call."""
    async def work(gate: asyncio.Future[int]) -> int:
        return await gate

    async def turns_to_wake(shielded: bool) -> int:
        loop = asyncio.get_running_loop()
        gate: asyncio.Future[int] = loop.create_future()
        if shielded:
            waited, _ = shielded_work(work(gate))
        else:
            waited = asyncio.shield(own_work(work(gate)))
        woke = asyncio.ensure_future(asyncio.wait_for(waited, 10))
        await asyncio.sleep(0)
        gate.set_result(1)
        turns = 0
        while not woke.done():
            turns += 1
            await asyncio.sleep(0)
        return turns

    async def main() -> None:
        assert await turns_to_wake(True) < await turns_to_wake(False)

    asyncio.run(main())


def test_cancelling_the_caller_leaves_shielded_work_running_and_holds_it() -> None:
    async def work(gate: asyncio.Future[int], done: list) -> int:
        value = await gate + 1
        done.append(value)
        return value

    async def caller(gate: asyncio.Future[int], done: list, box: list) -> int:
        outcome, running = shielded_work(work(gate, done))
        box.append(running)
        try:
            return await outcome
        except asyncio.CancelledError:
            detach(running)
            raise

    async def main() -> None:
        gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        done: list = []
        box: list = []
        call = asyncio.ensure_future(caller(gate, done, box))
        await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert box[0] in _DETACHED  # held: the loop keeps only weak references to tasks
        gate.set_result(1)
        for _ in range(5):
            await asyncio.sleep(0)
        assert done == [2] and box[0].done() and box[0] not in _DETACHED

    asyncio.run(main())


def test_cancelling_shielded_work_itself_cancels_its_outcome() -> None:
    async def work(gate: asyncio.Future[int]) -> int:
        return await gate

    async def main() -> None:
        gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        outcome, running = shielded_work(work(gate))
        await asyncio.sleep(0)
        running.cancel()  # as a stopping loop cancels what is pending
        with pytest.raises(asyncio.CancelledError):
            await outcome

    asyncio.run(main())
