"""Draw one sync step of a trunk timeline (``python -m bench.trunk --timeline FILE``) as a PNG.

``python -m bench.timeline_plot FILE OUT.png`` draws the median step: a row per client with when it sent its
Forward and Backward and when the server's handlers took them in and answered, a row for the device thread's
busy spans and one for the GPU's. Needs matplotlib (the ``plots`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

#: Marks drawn per client row: kind -> (marker, colour, label).
MARKS = {
    "client-forward-sent": ("|", "tab:blue", "client sends Forward"),
    "forward-in": (">", "tab:blue", "server takes Forward in"),
    "forward-out": ("<", "tab:blue", "server answers Forward"),
    "client-backward-sent": ("|", "tab:orange", "client sends Backward"),
    "backward-in": (">", "tab:orange", "server takes Backward in"),
    "backward-out": ("<", "tab:orange", "server answers Backward"),
}


def median_step(events: list[dict[str, Any]]) -> tuple[float, float]:
    """The bounds of the median sync step (between two consecutive trunk steps)."""
    steps = [e["t"] for e in events if e["kind"] == "step"]
    if len(steps) < 2:
        raise SystemExit("the recording holds fewer than two trunk steps; record more steps")
    spans = sorted(zip(steps, steps[1:]), key=lambda s: s[1] - s[0])
    return spans[len(spans) // 2]


def draw(events: list[dict[str, Any]], out: Path, title: str = "") -> None:
    """Write the median step of ``events`` to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lo, hi = median_step(events)
    inside = [e for e in events if lo - 0.002 <= e["t"] <= hi + 0.002]
    clients = sorted({e["client"] for e in inside if e["client"] and e["kind"] in MARKS},
                     key=lambda c: min(e["t"] for e in inside if e["client"] == c))
    row = {c: i + 2 for i, c in enumerate(clients)}
    fig, ax = plt.subplots(figsize=(11, 2 + 0.16 * len(clients)))
    seen: set[str] = set()
    for e in inside:
        if e["kind"] in MARKS and e["client"] in row:
            marker, colour, label = MARKS[e["kind"]]
            ax.plot((e["t"] - lo) * 1e3, row[e["client"]], marker=marker, color=colour, markersize=5,
                    linestyle="", label=None if label in seen else label)
            seen.add(label)
    for y, (kind, thread, colour) in enumerate([("gpu", "gpu", "tab:green"), ("host", "device", "tab:red")]):
        spans = [((e["t"] - lo) * 1e3, (e["end"] - e["t"]) * 1e3) for e in events
                 if e["kind"] == kind and e["thread"].endswith(thread) and e["end"] >= lo and e["t"] <= hi]
        ax.broken_barh(spans, (y - 0.35, 0.7), color=colour)
    ax.set_yticks([0, 1] + [row[c] for c in clients])
    ax.set_yticklabels(["GPU", "device thread"] + [c.replace("bench-", "client ") for c in clients], fontsize=6)
    ax.set_xlim(0, (hi - lo) * 1e3)
    ax.set_xlabel("ms since the previous trunk step")
    ax.set_title(title or "one sync step", fontsize=9)
    ax.legend(fontsize=6, loc="upper right", ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.timeline_plot", description=__doc__)
    parser.add_argument("timeline", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    draw(json.loads(args.timeline.read_text()), args.out, args.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
