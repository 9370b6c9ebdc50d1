"""Liveness on a busy server: the time a member's request waits in the trunk's own device queue is not counted as
the member's silence, so a slow, loaded machine does not drop live clients from the step group."""

from __future__ import annotations

import threading
import time

import torch
from conftest import tiny_model

from splitfed.split import CutState, split_model
from splitfed.trunk.aggregation.modes import make_aggregator
from splitfed.trunk.compute.runtime import TrunkRuntime
from splitfed.trunk.scheduler import TrunkScheduler

TIMEOUT = 1.0


def test_a_member_whose_forward_waits_in_the_device_queue_is_not_dropped() -> None:
    split = split_model(tiny_model("llama", layers=2).train(), cuts=(1, 2))
    runtime = TrunkRuntime(split.trunk, torch.optim.SGD(split.trunk.parameters(), lr=0.01),
                           aggregator=make_aggregator("sync", timeout=TIMEOUT))
    scheduler = TrunkScheduler(runtime).start()
    try:
        runtime.join("queued")
        runtime.join("silent")
        # Execute: the device thread is busy (another client's long work) past both members' deadlines; "queued"
        # sent a training forward before its deadline, which waits in the queue behind that work.
        busy = threading.Event()
        held = scheduler.call(lambda: busy.wait(10 * TIMEOUT))
        forward = scheduler.call(lambda: runtime.forward("queued", "a1", CutState(torch.randn(1, 3, 32)), train=True))
        time.sleep(2.5 * TIMEOUT)
        busy.set()
        held.result(30)
        forward.result(30)
        scheduler.call(lambda: None).result(30)  # the device thread has polled since
        # Assert: the member with a queued request stays; the one that sent nothing is gone.
        deadline = time.monotonic() + 10 * TIMEOUT
        while "silent" in runtime.aggregator.members and time.monotonic() < deadline:
            time.sleep(0.05)
        assert runtime.aggregator.members == {"queued"}
        stats = runtime.aggregator.stats
        assert stats["expired-members"] == 1 and stats["dropped-members"] == 0, stats  # "queued" never left
    finally:
        scheduler.stop()


def test_a_saved_forward_does_not_expire_while_its_backward_waits_in_the_device_queue() -> None:
    """The sweep half: saved forwards expire only while the device queue is current, so a Backward that reached
    the queue in time finds its forward even when the device thread was busy past the forward's TTL."""
    from splitfed.trunk.compute.store import StoreLimits

    split = split_model(tiny_model("llama", layers=2).train(), cuts=(1, 2))
    runtime = TrunkRuntime(split.trunk, torch.optim.SGD(split.trunk.parameters(), lr=0.01),
                           aggregator=make_aggregator("sync", timeout=30.0), limits=StoreLimits(ttl_s=TIMEOUT))
    scheduler = TrunkScheduler(runtime, sweep_period_s=0.2).start()
    try:
        runtime.join("late")
        hidden = CutState(torch.randn(1, 3, 32))
        scheduler.call(lambda: runtime.forward("late", "a1", hidden, train=True)).result(30)
        # Execute: the device thread is busy (another client's long work) past the saved forward's TTL and
        # several sweep periods; "late" sent its Backward in time, and it waits in the queue behind that work.
        busy = threading.Event()
        held = scheduler.call(lambda: busy.wait(10 * TIMEOUT))
        backward = scheduler.call(lambda: runtime.start_backward("late", "a1", torch.ones(1, 3, 32) * 1e-3))
        time.sleep(2.5 * TIMEOUT)
        busy.set()
        held.result(30)
        # Assert: the Backward found its forward (the sweep waited for the backlog); nothing was evicted.
        pending = backward.result(30)
        assert pending.grad_in.result(30).shape == (1, 3, 32)
        assert runtime.store.find("a1") is None and runtime.stats["backwards"] == 1
        assert "late" in runtime.aggregator.members
    finally:
        scheduler.stop()
