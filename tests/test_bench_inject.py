"""``bench.inject`` (``python -m bench.trunk --inject``): a known delay in one part of a trunk server's chain at a
time, and how much of it a sync step shows. Each delay must land in its part, and each part must be whole again
after its run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.inject import ENV, InjectError, delayed, parse, path_ms

ROOT = Path(__file__).resolve().parent.parent
TINY = "layers=3 hidden=32 heads=2 vocab=64 batch=1 seq=8"  # bench.core's SPLIT_STEP keys


def test_parse_takes_parts_and_microseconds() -> None:
    assert parse(["loop=100", "client=2.5"]) == {"loop": 100.0, "client": 2.5}
    assert parse(["frontend=300"], frontends=2) == {"frontend": 300.0}
    assert parse([], one_trunk=False) == {}


@pytest.mark.parametrize("items, kwargs, says", [
    (["gpu=100"], {}, "PART one of loop, device, frontend, client"),
    (["loop"], {}, "PART=MICROSECONDS"),
    (["loop=fast"], {}, "not a number"),
    (["loop=-5"], {}, "positive"),
    (["loop=nan"], {}, "positive"),
    (["frontend=100"], {"frontends": 0}, "--frontends 1 or more"),
    (["loop=100"], {"one_trunk": False}, "no --serve, --connect or --replicas"),
    (["loop=100"], {"batched": False}, "--only must hold batched"),
])
def test_parse_refuses_what_it_cannot_inject(items: list[str], kwargs: dict, says: str) -> None:
    with pytest.raises(InjectError, match=says.replace("-", r"\-")):
        parse(items, **kwargs)


def test_a_step_adds_each_delay_along_its_path() -> None:
    assert path_ms("loop", 100, clients=32, frontends=4) == pytest.approx(6.4)  # 64 calls through one loop
    assert path_ms("device", 100, clients=32, frontends=4) == pytest.approx(3.2)  # 32 forwards in the batch
    assert path_ms("frontend", 100, clients=32, frontends=4) == pytest.approx(1.6)  # 8 clients' 16 calls a front-end
    assert path_ms("frontend", 100, clients=5, frontends=2) == pytest.approx(0.6)  # the busier takes 3 clients
    assert path_ms("client", 100, clients=32, frontends=4) == pytest.approx(0.2)  # side by side


def test_delays_are_in_place_within_and_gone_after() -> None:
    from splitfed.channel.engine import frontend
    from splitfed.channel.server.servicer import SplitChannelServicer
    from splitfed.trunk.scheduler import TrunkScheduler

    before = (SplitChannelServicer._forward, SplitChannelServicer._backward, TrunkScheduler._run, frontend.serve)
    assert ENV not in os.environ
    with delayed({"loop": 100, "device": 200, "frontend": 300, "client": 400}):
        now = (SplitChannelServicer._forward, SplitChannelServicer._backward, TrunkScheduler._run, frontend.serve)
        assert all(a is not b for a, b in zip(now, before))
        assert json.loads(os.environ[ENV]) == pytest.approx({"loop": 1e-4, "device": 2e-4, "frontend": 3e-4,
                                                             "client": 4e-4})
    assert (SplitChannelServicer._forward, SplitChannelServicer._backward, TrunkScheduler._run,
            frontend.serve) == before
    assert ENV not in os.environ
    with pytest.raises(RuntimeError), delayed({"loop": 100}):  # a run that fails leaves nothing slowed either
        raise RuntimeError("the run failed")
    assert SplitChannelServicer._forward is before[0] and ENV not in os.environ


def test_causal_reports_how_much_of_each_delay_a_step_shows() -> None:
    """A part on the path passes its whole delay on to the step (share 1), one with slack none of it (share 0)."""
    from bench.inject import causal

    base_ms = 50.0  # a step of 4 clients x 4 examples as it is
    added = {"loop": 3.2, "client": 0.0}  # the step's milliseconds with each part slowed by 100 us a call
    current: list[str] = []

    def run() -> float:  # examples/s of a run with the part now slowed (read from the environment)
        part = next(iter(json.loads(os.environ[ENV])))
        current.append(part)
        return 16 / ((base_ms + added[part]) / 1e3)

    out = causal(run, 16 / (base_ms / 1e3), {"loop": 100, "client": 100}, clients=4, frontends=1,
                 examples_per_step=16)
    assert current == ["loop", "client"] and ENV not in os.environ
    assert out["inject_path_ms_loop"] == pytest.approx(0.8) and out["inject_path_ms_client"] == pytest.approx(0.2)
    assert out["inject_step_ms_added_loop"] == pytest.approx(3.2) and out["inject_share_loop"] == pytest.approx(4.0)
    assert out["inject_step_ms_added_client"] == pytest.approx(0.0, abs=1e-9) and out["inject_share_client"] == 0
    assert out["inject_examples_per_s_loop_4"] == pytest.approx(16 / 0.0532)


@pytest.mark.slow
def test_each_delay_lands_in_its_part() -> None:
    """Two clients, one front-end, 100 ms in each part in turn, through the command: with two clients every part is
    on the step's path (one loop and one front-end take every call, one device thread runs both forwards, each
    client waits for the other), so no step can be shorter than the delays it holds, however busy the machine is
    (it only makes steps longer); a delay that did not land leaves steps of a few milliseconds."""
    done = subprocess.run([sys.executable, "-m", "bench.trunk", "--device", "cpu", "--clients", "2", "--repeat", "1",
                           "--steps", "3", "--frontends", "1", "--only", "batched", "--config", TINY, "--json",
                           "--inject", "loop=100000", "device=100000", "frontend=100000", "client=100000"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for part, path in (("loop", 400), ("device", 200), ("frontend", 400), ("client", 200)):
        assert results[f"inject_path_ms_{part}"] == pytest.approx(path)
        step_ms = 2 / results[f"inject_examples_per_s_{part}_2"] * 1e3  # 2 clients x 1 example a step
        assert step_ms >= 0.9 * path, (part, step_ms, results)
        assert {f"inject_step_ms_added_{part}", f"inject_share_{part}"} <= results.keys()
