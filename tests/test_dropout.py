"""A client that dies mid-step through the real apps: it joined the trunk's step group and sent its first
forward, then nothing (no backward, no leave, as a crashed process). The sync trunk drops it after
``trunk-timeout`` and the round goes on with the others; the failure is counted."""

from __future__ import annotations

import json
import threading
import time

from flower_harness import run_apps

TIMEOUT = 8.0


def test_a_client_dying_after_its_first_forward_is_dropped_and_the_round_goes_on(tmp_path, monkeypatch) -> None:
    import apps.client_app as client_app

    from splitfed.trunk.aggregation.modes import TrunkAggregator

    real_connect = client_app.connect_trunk
    armed = {"node-101": True}  # the first trunk of partition 1 (its round-1 training) dies
    lock = threading.Lock()
    last_forward: list[float] = []
    drops: list[tuple[float, list[str], bool]] = []
    real_on_drop = TrunkAggregator.on_drop

    def on_drop(self, dropped, held_up_a_step):  # type: ignore[no-untyped-def]
        drops.append((time.monotonic(), list(dropped), held_up_a_step))
        real_on_drop(self, dropped, held_up_a_step)

    monkeypatch.setattr(TrunkAggregator, "on_drop", on_drop)

    def connect(cfg, address, token, client_id, **kwargs):  # type: ignore[no-untyped-def]
        trunk = real_connect(cfg, address, token, client_id, **kwargs)
        with lock:
            doomed = armed.pop(client_id, False)
        if doomed:
            real_forward = trunk.forward

            def forward_once(*args, **kwargs):  # type: ignore[no-untyped-def]
                out = real_forward(*args, **kwargs)
                last_forward.append(time.monotonic())
                trunk.forward = _crash
                return out

            trunk.forward = forward_once
            trunk.client.leave = lambda: 0  # a crashed process never says goodbye,
            real_close = trunk.client.close

            def close_without_goodbye() -> None:  # not even when its channels close (close() leaves the group)
                trunk.client.member = False
                real_close()

            trunk.client.close = close_without_goodbye
        return trunk

    monkeypatch.setattr(client_app, "connect_trunk", connect)
    _, out = run_apps(tmp_path, num_nodes=3, concurrency=3, num_server_rounds=1, local_steps=3,
                      trunk_mode="sync", trunk_timeout=TIMEOUT)
    (round1,) = json.loads((out / "history.json").read_text())["rounds"]
    assert not armed  # the doomed client did run
    assert round1["trunk"]["trunk-dropped-members"] == 1
    assert round1["failures"]["train"] == 1 and "process crashed" in round1["failures"]["first-error"]
    assert round1["train"]["train-steps"] == 2 * 3  # the two others trained every step
    assert round1["evaluate"]["num-examples"] == 1000  # all three evaluated
    # The others waited for the dead member once, for between one and two trunk-timeouts after its last
    # sign of life (the trunk polls for silent members), not at every step.
    ((dropped_at, dropped, held_up),) = [d for d in drops if d[2]]
    assert dropped == ["node-101"] and held_up
    assert TIMEOUT <= dropped_at - last_forward[0] < 2 * TIMEOUT
    assert round1["seconds"] >= TIMEOUT


def _crash(*args, **kwargs):  # type: ignore[no-untyped-def]
    raise RuntimeError("process crashed after its first forward")
