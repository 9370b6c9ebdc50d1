"""Which part of a trunk server's chain holds a sync step: a known delay put into one part at a time.

Causal profiling, as Coz does it: slow one part down by a known amount and see how much longer the step gets. A
part whose whole delay shows up in the step is on the step's critical path; one whose delay vanishes has slack,
and making it faster would not make the step shorter. ``python -m bench.trunk --inject loop=100 frontend=300``
runs the batched throughput once as it is and once per part with that part slowed (microseconds of busy CPU,
holding the interpreter lock as the part's own work does), and reports for each part:

* ``inject_examples_per_s_<part>_<N>``: the throughput with that part slowed;
* ``inject_step_ms_added_<part>``: how much longer a sync step got, in milliseconds (from the examples/s);
* ``inject_path_ms_<part>``: how much the delay adds to one step if every bit of it is on the critical path;
* ``inject_share_<part>``: the first over the second: about 1 on the critical path, about 0 with slack.

The parts (and where the delay goes):

* ``loop``: the engine's event loop, at the start of each Forward and Backward it serves (the servicer's
  ``_forward`` and ``_backward``); one loop serves every call in turn: ``2 N`` delays a step;
* ``device``: the trunk's device thread, per forward in each batch it runs, before the batch (``N`` a step);
* ``frontend``: a front-end process, before it hands a call over (``--frontends`` >= 1); the kernel spreads the
  clients' connections over the front-ends, so one takes about ``N / F`` clients' calls in turn: ``2 N / F``;
* ``client``: a bench client, before each call it sends; the clients run side by side: ``2`` a step.

Steps are noisy: compare a share well away from 0 or 1 across runs, not a single figure.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

PARTS = ("loop", "device", "frontend", "client")
#: The delays (seconds) of a run, for the processes it spawns (front-ends and clients read it when they start).
ENV = "SPLITFED_BENCH_DELAYS"


class InjectError(ValueError):
    """A ``--inject`` item that names no part or no delay."""


def parse(items: Sequence[str], *, one_trunk: bool = True, batched: bool = True, frontends: int = 0
          ) -> dict[str, float]:
    """``["loop=100", "client=500"]`` -> ``{"loop": 100.0, "client": 500.0}`` (microseconds), for a bench of one
    trunk's batched runs (``one_trunk``, ``batched``) with ``frontends`` front-end processes."""
    if items and not (one_trunk and batched):
        raise InjectError("--inject slows parts of one trunk's batched runs: no --serve, --connect or --replicas, "
                          "and --only must hold batched")
    out: dict[str, float] = {}
    for item in items:
        part, sep, value = item.partition("=")
        if part not in PARTS or not sep:
            raise InjectError(f"--inject {item!r}: give PART=MICROSECONDS with PART one of {', '.join(PARTS)}")
        try:
            us = float(value)
        except ValueError:
            raise InjectError(f"--inject {item!r}: {value!r} is not a number of microseconds") from None
        if not math.isfinite(us) or us <= 0:
            raise InjectError(f"--inject {item!r}: the delay must be a positive number of microseconds")
        out[part] = us
    if "frontend" in out and frontends < 1:
        raise InjectError("--inject frontend=... needs --frontends 1 or more")
    return out


def spin(seconds: float) -> None:
    """Keep this thread busy for ``seconds`` (holding the interpreter lock, as Python work does)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _delays() -> dict[str, float]:
    """This process's delays in seconds, from :data:`ENV`."""
    return {k: float(v) for k, v in json.loads(os.environ.get(ENV) or "{}").items()}


def client_delay() -> float:
    """The delay a bench client keeps before each call (seconds; 0: none)."""
    return _delays().get("client", 0.0)


def _slowed(fn: Callable[..., Any], seconds: float) -> Callable[..., Any]:
    """The coroutine function ``fn`` with ``seconds`` of busy work before it."""
    @functools.wraps(fn)
    async def slowed(*args: Any, **kwargs: Any) -> Any:
        spin(seconds)
        return await fn(*args, **kwargs)
    return slowed


def serve_frontend(config: Any, ready: Any) -> None:
    """A front-end process's entry point with its delay (started instead of ``frontend.serve``, by reference)."""
    from splitfed.channel.engine import frontend

    seconds = _delays().get("frontend", 0.0)
    if seconds:
        frontend._Forward._hand_over = _slowed(frontend._Forward._hand_over, seconds)  # type: ignore[method-assign]
    frontend.serve(config, ready)


@contextlib.contextmanager
def delayed(delays_us: dict[str, float]) -> Iterator[None]:
    """Within: the parts in ``delays_us`` slowed (this process's engine; the front-ends and clients it spawns)."""
    from splitfed.channel.engine import frontend
    from splitfed.channel.server.servicer import SplitChannelServicer
    from splitfed.trunk.scheduler import TrunkScheduler

    seconds = {part: us * 1e-6 for part, us in delays_us.items()}
    saved = (SplitChannelServicer._forward, SplitChannelServicer._backward, TrunkScheduler._run, frontend.serve,
             os.environ.get(ENV))
    run = TrunkScheduler._run

    def device_run(self: Any, batch: list[Any]) -> None:
        spin(seconds["device"] * sum(1 for t in batch if t.forward is not None))
        run(self, batch)

    try:
        os.environ[ENV] = json.dumps(seconds)
        if "loop" in seconds:
            SplitChannelServicer._forward = _slowed(saved[0], seconds["loop"])  # type: ignore[method-assign]
            SplitChannelServicer._backward = _slowed(saved[1], seconds["loop"])  # type: ignore[method-assign]
        if "device" in seconds:
            TrunkScheduler._run = device_run  # type: ignore[method-assign]
        if "frontend" in seconds:
            frontend.serve = serve_frontend
        yield
    finally:
        SplitChannelServicer._forward, SplitChannelServicer._backward, TrunkScheduler._run, frontend.serve = saved[:4]
        if saved[4] is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved[4]


def path_ms(part: str, us: float, clients: int, frontends: int) -> float:
    """What ``us`` in ``part`` adds to one sync step of ``clients`` clients if all of it is on the critical path."""
    per_step = {"loop": 2 * clients, "device": clients, "client": 2,
                "frontend": 2 * math.ceil(clients / max(frontends, 1))}[part]
    return per_step * us / 1e3


def causal(run: Callable[[], float], base: float, delays_us: dict[str, float], clients: int, frontends: int,
           examples_per_step: int) -> dict[str, float]:
    """For each part in ``delays_us``: ``run()`` (examples/s) with that part slowed, against ``base`` (examples/s
    as it is), as the ``inject_*`` keys of the module docstring."""
    out: dict[str, float] = {}
    for part, us in delays_us.items():
        with delayed({part: us}):
            slowed = run()
        added = (examples_per_step / slowed - examples_per_step / base) * 1e3
        path = path_ms(part, us, clients, frontends)
        out[f"inject_examples_per_s_{part}_{clients}"] = slowed
        out[f"inject_step_ms_added_{part}"] = added
        out[f"inject_path_ms_{part}"] = path
        out[f"inject_share_{part}"] = added / path
    return out
