"""The figures of a recorded trunk timeline (``bench.trunk --timeline``, ``bench.trunk_remote``): its median sync
step's, and every step's length."""

from __future__ import annotations

import itertools
from typing import Any


def step_figures(events: list[dict[str, Any]]) -> dict[str, float]:
    """The figures of the median sync step of a recording (between two consecutive trunk steps), and of all its
    steps' lengths (with the garbage collector's part in the long ones)."""
    from splitfed.trunk.timeline import hops, step_lengths, summarize

    steps = [e["t"] for e in events if e["kind"] == "step"]
    if len(steps) < 2:
        return summarize(events)
    spans = sorted(itertools.pairwise(steps), key=lambda s: s[1] - s[0])
    lo, hi = spans[len(spans) // 2]
    return {**summarize(events, lo, hi), **step_lengths(events), **hops(events)}
