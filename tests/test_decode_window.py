"""The batching window of decode steps: it closes once every decoding session has its step in, stays open while
steps keep coming, and a session that stops decoding holds the others only for a bounded time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import pytest
import torch
from conftest import tiny_model

from splitfed.split import CutState, split_model
from splitfed.trunk.inference.decoding import MAX_MISSED, SessionStep, evaluating
from splitfed.trunk.compute.requests import Promise
from splitfed.trunk.compute.runtime import TrunkRuntime
from splitfed.trunk.scheduler import ITEM_WINDOW_BOUND, TrunkScheduler, _Task
from splitfed.trunk.inference.sessions import SessionManager

pytestmark = pytest.mark.usefixtures("one_thread")

RESULT_TIMEOUT_S = 30.0  # far below the long windows below: a step done within it did not wait for its window


class _Decoding:
    """Sessions on a real trunk, a scheduler over them, and one-position steps to submit."""

    def __init__(self, sessions: int, window_ms: float) -> None:
        trunk = split_model(tiny_model("gpt2"), (1, 3)).trunk
        self.width = trunk.config.hidden_size
        self.manager = SessionManager(TrunkRuntime(trunk))
        self.scheduler = TrunkScheduler(self.manager.runtime, batch_window_ms=window_ms)
        self.g = torch.Generator().manual_seed(0)
        self.ids = []
        for i in range(sessions):
            sid, _ = self.manager.open("c", max_length=64)
            self.manager.step("c", sid, CutState(torch.randn(1, 3 + i, self.width, generator=self.g)))
            self.ids.append(sid)

    def step(self, i: int) -> SessionStep:
        return SessionStep("c", self.ids[i], CutState(torch.randn(1, 1, self.width, generator=self.g)))

    def seed(self, members: list[int]) -> None:
        """One window of these sessions, run directly: from now on they are decoding."""
        for out in self.manager.run_many([self.step(i) for i in members]):
            assert not isinstance(out, BaseException), out

    def submit(self, i: int) -> Future[torch.Tensor]:
        return self.scheduler.batched(self.manager, self.step(i), 1)


@pytest.fixture
def decoding() -> Iterator[Callable[[int, float], _Decoding]]:
    made: list[_Decoding] = []

    def make(sessions: int, window_ms: float) -> _Decoding:
        made.append(_Decoding(sessions, window_ms))
        return made[-1]

    yield make
    for d in made:
        d.scheduler.stop()


def test_the_window_closes_once_every_decoding_session_has_its_step_in(decoding) -> None:
    # Prepare: three sessions decoding; a window of a minute
    d = decoding(3, 60_000)
    d.seed([0, 1, 2])
    d.scheduler.start()
    # Execute: each session sends its next step
    futures = [d.submit(i) for i in range(3)]
    outs = [f.result(timeout=RESULT_TIMEOUT_S) for f in futures]
    # Assert: one batched call of the three, closed early (long before the minute)
    assert all(o.shape == (1, 1, d.width) for o in outs)
    stats = d.scheduler.stats
    assert (stats["item-batches"], stats["batched-items"], stats["early-closes"]) == (1, 3, 1), stats


def test_the_window_stays_open_while_steps_keep_coming(decoding) -> None:
    # Prepare: four sessions decoding; a window of 1 s
    d = decoding(4, 1000)
    d.seed([0, 1, 2, 3])
    d.scheduler.start()
    # Execute: the steps arrive 0.4 s apart, 1.2 s from the first to the last (more than one window)
    futures = []
    for i in range(4):
        if i:
            time.sleep(0.4)
        futures.append(d.submit(i))
    for f in futures:
        f.result(timeout=RESULT_TIMEOUT_S)
    # Assert: each step came within a window of the one before: all four ran as one call
    stats = d.scheduler.stats
    assert (stats["item-batches"], stats["batched-items"], stats["early-closes"]) == (1, 4, 1), stats


def test_a_session_that_stops_decoding_is_waited_for_only_a_few_windows(decoding) -> None:
    # Prepare: three sessions decoding; a short window
    d = decoding(3, 150)
    d.seed([0, 1, 2])
    d.scheduler.start()
    closes = []
    # Execute: session 2 stops; the other two go on for MAX_MISSED + 2 windows
    for _ in range(MAX_MISSED + 2):
        futures = [d.submit(0), d.submit(1)]
        for f in futures:
            f.result(timeout=RESULT_TIMEOUT_S)
        closes.append(d.scheduler.stats["early-closes"])
    # Assert: every window ran both steps together; the first MAX_MISSED waited for session 2 (closed by the
    # window), the later ones no longer did (closed as soon as both were in)
    stats = d.scheduler.stats
    assert (stats["item-batches"], stats["batched-items"]) == (MAX_MISSED + 2, 2 * (MAX_MISSED + 2)), stats
    assert closes == [0] * MAX_MISSED + [1, 2]
    assert d.manager._sessions[d.ids[2]].group is None  # left out of the group as well
    # ...and it decodes exactly when it comes back
    assert d.submit(2).result(timeout=RESULT_TIMEOUT_S).shape == (1, 1, d.width)


def test_the_window_never_stays_open_past_its_bound(decoding) -> None:
    # Prepare: three sessions decoding, a window of a minute; a step queued longer ago than the bound, one just now
    d = decoding(3, 60_000)
    d.seed([0, 1, 2])
    now = time.monotonic()
    d.scheduler._queue.extend([
        _Task(None, Promise(), runner=d.manager, item=d.step(0), tokens=1,
              queued=now - ITEM_WINDOW_BOUND * 60.0 - 1.0),
        _Task(None, Promise(), runner=d.manager, item=d.step(1), tokens=1, queued=now)])
    taken: list[list[_Task]] = []

    def take() -> None:
        with d.scheduler._cond:
            taken.append(d.scheduler._take())

    # Execute: session 2 never sends its step, and the latest step arrived just now (its minute has not passed)
    t = threading.Thread(target=take, daemon=True)
    t.start()
    t.join(RESULT_TIMEOUT_S)
    # Assert: the window closed at once with the two steps
    assert not t.is_alive()
    assert [task.item.session_id for task in taken[0]] == d.ids[:2]


def test_evaluating_switches_training_modules_only_and_restores_them() -> None:
    # Prepare: a trunk in training mode with one submodule left in eval mode
    trunk = split_model(tiny_model("gpt2"), (1, 3)).trunk.train()
    frozen = next(m for m in trunk.modules() if m is not trunk)
    frozen.eval()
    before = {name: m.training for name, m in trunk.named_modules()}
    # Execute
    with evaluating(trunk):
        inside = [m.training for m in trunk.modules()]
    # Assert: nothing trains inside; afterwards every module is as it was
    assert not any(inside)
    assert {name: m.training for name, m in trunk.named_modules()} == before
