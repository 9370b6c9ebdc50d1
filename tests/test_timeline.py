"""The server's timeline records the garbage collector's collections while it records, and nothing once stopped;
its step figures say which long steps a collection fell in."""

from __future__ import annotations

import gc

from splitfed.trunk.replicas.aggregation import BUSY, READY
from splitfed.trunk.timeline import Timeline, hops, step_lengths, summarize


def _cycles(n: int) -> None:
    for _ in range(n):
        a: list = []
        a.append(a)


def test_a_collection_while_recording_is_a_span_of_its_own() -> None:
    timeline = Timeline()
    timeline.start()
    _cycles(1000)
    gc.collect()  # a full collection, on this thread
    events = timeline.stop()
    spans = [e for e in events if e["kind"] == "gc"]
    assert spans, "the collection was not recorded"
    full = [e for e in spans if e["generation"] == 2]
    assert full and full[-1]["end"] >= full[-1]["t"] >= 0
    assert sum(e["collected"] for e in spans) >= 1000  # the cycles, in the full collection or automatic ones before it
    figures = summarize(events)
    assert figures["gc_full_count"] >= 1 and figures["gc_ms"] > 0 and figures["gc_longest_ms"] > 0
    # Stopped: the hook is gone, and a later collection is not recorded.
    assert not any(getattr(cb, "__self__", None) is timeline for cb in gc.callbacks)
    gc.collect()
    assert [e for e in timeline.events() if e["kind"] == "gc"] == spans


def test_step_lengths_name_the_long_steps_a_collection_fell_in() -> None:
    steps = [{"t": t, "kind": "step", "client": "", "thread": "device"} for t in (0.0, 0.05, 0.10, 0.30, 0.35, 0.55)]
    collection = {"t": 0.15, "end": 0.25, "kind": "gc", "client": "", "thread": "loop", "generation": 2,
                  "collected": 7}
    short = {"t": 0.40, "end": 0.401, "kind": "gc", "client": "", "thread": "loop", "generation": 0, "collected": 0}
    figures = step_lengths([*steps, collection, short])
    assert figures["steps"] == 5 and round(figures["step_median_ms"]) == 50 and round(figures["step_longest_ms"]) == 200
    # 0.10-0.30 holds the 100 ms collection; 0.35-0.55 is as long but holds only a 1 ms one.
    assert figures["long_steps"] == 2 and figures["long_steps_with_gc"] == 1
    assert figures["run_gc_count"] == 2 and figures["run_gc_full_count"] == 1 and round(figures["run_gc_longest_ms"]) == 100


def _mark(t: float, kind: str, client: str = "", **info: object) -> dict:
    return {"t": t, "kind": kind, "client": client, "thread": "client" if kind.startswith("client") else "x", **info}


def test_hops_time_each_call_between_a_client_and_the_engine_and_the_hand_overs_around_the_gpu() -> None:
    """Two sync steps of two clients, times in ms from the step before: every hop is read off the marks of one
    client (its own and the server's), the intake gap off consecutive Forwards, the hand-overs off the GPU's spans."""
    events = [_mark(0.0, "step")]
    for lo, slow in ((0.0, ""), (0.1, "b")):  # in the second step, client b's reply takes 2 ms longer to reach it
        def at(ms: float) -> float:
            return lo + ms / 1e3
        for client, late in (("a", 0.0), ("b", 1.0)):
            extra = 2.0 if client == slow else 0.0
            events += [_mark(at(1 + late), "backward-out", client),
                       _mark(at(3 + late + extra), "client-backward-got", client),
                       _mark(at(3 + late + extra), "client-forward-sent", client),
                       _mark(at(7 + late + extra), "forward-in", client),
                       _mark(at(30 + late), "forward-out", client),
                       _mark(at(32 + late), "client-backward-sent", client),
                       _mark(at(36 + late), "backward-in", client)]
        events += [_mark(at(10), "window"),
                   {"t": at(12), "end": at(20), "kind": "gpu", "client": "", "thread": "gpu", "what": "forward"},
                   {"t": at(39), "end": at(50), "kind": "gpu", "client": "", "thread": "gpu", "what": "backward"},
                   _mark(at(49), "offer", n=1), _mark(at(50.5), "offer", n=1),  # a batch's, then the last one
                   {"t": at(51), "end": at(52), "kind": "gpu", "client": "", "thread": "gpu", "what": "step"},
                   _mark(at(52.5), "step")]
    figures = hops(events)
    assert round(figures["hop_backward_out_to_got_ms"], 6) == 2.0  # 2, 2, 2 and 4 ms
    assert round(figures["hop_backward_out_to_got_p90_ms"], 6) == 4.0
    assert round(figures["hop_forward_sent_to_in_ms"], 6) == 4.0
    assert round(figures["hop_forward_out_to_backward_sent_ms"], 6) == 2.0
    assert round(figures["hop_backward_sent_to_in_ms"], 6) == 4.0
    assert round(figures["hop_intake_gap_ms"], 6) == 3.0  # gaps of 1 and 3 ms: the upper of the middle two
    assert round(figures["hop_window_to_gpu_ms"], 6) == 2.0
    assert round(figures["hop_gpu_to_first_reply_ms"], 6) == 10.0
    assert round(figures["hop_gpu_to_last_reply_ms"], 6) == 11.0
    assert round(figures["hop_last_gradient_to_gpu_ms"], 6) == 2.0
    assert round(figures["hop_backward_to_step_ms"], 6) == 1.0
    assert round(figures["hop_backward_to_offer_ms"], 6) == 0.5 and round(figures["hop_offer_to_step_ms"], 6) == 2.0
    assert hops([_mark(0.0, "step")]) == {}  # no whole step: nothing to time


def test_hops_time_a_replicas_wait_from_its_gradients_in_to_its_step() -> None:
    """Two steps of a replica, times in ms: busy ticks, then a tick entered with every gradient in that waits
    for the other replica, a vote, the step; the second step's first proposal is vetoed."""
    def tick(ms: float, own: int, waited_ms: float) -> dict:
        return _mark(ms / 1e3, "replica-tick", own=own, ready=1, busy=1, waited=waited_ms / 1e3)

    def vote(ms: float, vetoed: int, waited_ms: float) -> dict:
        return _mark(ms / 1e3, "replica-vote", vetoed=vetoed, waited=waited_ms / 1e3)

    events = [_mark(0.0, "step"),
              tick(5, BUSY, 1), tick(30, READY, 4), vote(31, 0, 0.5), _mark(0.040, "step"),  # ready at 26: 14 ms
              tick(45, BUSY, 1), tick(60, READY, 2), vote(61, 1, 1), tick(70, READY, 3), vote(71, 0, 1),
              _mark(0.080, "step")]  # ready at 58: 22 ms, 2 + 1 + 3 + 1 of them waiting
    figures = hops(events)
    assert round(figures["hop_replica_ready_to_step_ms"], 6) == 22.0  # 14 and 22: the upper of the two
    assert round(figures["hop_replica_ready_to_step_p90_ms"], 6) == 22.0
    assert round(figures["hop_replica_ready_wait_ms"], 6) == 7.0  # 4.5 and 7
    assert figures["replica_ticks_per_step"] == 3 and figures["replica_vetoes"] == 1
    assert "replica_ticks_per_step" not in hops([_mark(0.0, "step"), _mark(0.05, "step")])  # no replica: none


def test_a_collection_that_starts_inside_a_mark_does_not_deadlock() -> None:
    """A collection can start in any allocation, also in the one a mark makes while it holds the timeline's lock;
    recording it must not wait for that lock (it did, and froze the whole server)."""
    import threading
    import time

    timeline = Timeline()
    finished: list[int] = []

    def record() -> None:
        for i in range(5_000):
            timeline.mark("forward-in", "c", i=i)  # allocates under the lock: with threshold 1, collects there
            with timeline.host("work"):
                pass
        finished.append(1)

    threshold = gc.get_threshold()
    gc.set_threshold(1)
    timeline.start()
    try:
        threads = [threading.Thread(target=record, daemon=True) for _ in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        for t in threads:
            t.join(max(deadline - time.monotonic(), 0))
        assert len(finished) == 3, "recording froze: a collection waited for the timeline's lock"
    finally:
        gc.set_threshold(*threshold)
        timeline.enabled = False  # not stop(): a frozen thread may hold the lock that stop() takes
        if timeline._collected in gc.callbacks:
            gc.callbacks.remove(timeline._collected)
    assert sum(e["kind"] == "gc" for e in timeline.events()) > 100
