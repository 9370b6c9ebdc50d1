"""Which backend serves a call: sticky pins per client and model, new clients by load (pure, no gRPC).

A client (its ``x-splitfed-client`` id, else its token, else its connection) is
pinned to one backend per model at its first call, and every later call of that
client for that model goes there: a Forward and its Backward, an inference
session's steps and a shared-memory region's calls all reach the backend that
holds their state, and a training client stays on one replica for its round.
A pin ends when the client leaves the step group (``Leave``) holding no session
or region, after ``sticky_idle_s`` without a call (when it holds none), or when
its backend goes down; the client's next call is then placed anew.

A new pin goes to the live backend holding the model with the fewest clients
pinned to it (a pin lasts a round or a session: it is the load that stays), then
the fewest calls in flight through the router (the load of the moment, which
only breaks ties: clients arriving together are spread evenly whatever their
calls' timing), then the bytes the trunk holds between requests (saved forwards,
KV caches) where its metrics report them, then the backend's position in the list.

Concurrency: a :class:`RouteTable` is used from one thread only (the router's
event loop), so it takes no lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

#: The model of a call that names none: any live backend serves it (a server holding one model serves it).
ANY_MODEL = ""


@dataclass(eq=False)
class BackendState:
    """What the router knows of one backend."""

    address: str
    index: int
    live: bool = False
    #: Models it is known to hold: its Info's model, and names its per-model health check reported serving.
    models: frozenset[str] = frozenset()
    #: Calls in flight through the router.
    in_flight: int = 0
    #: Clients pinned to it.
    pinned: int = 0
    #: Bytes its trunk holds between requests, from its metrics (None: not known).
    held_bytes: int | None = None

    def holds(self, model: str) -> bool:
        """Whether it serves ``model`` (any backend serves a call that names no model)."""
        return model == ANY_MODEL or model in self.models


@dataclass(eq=False)
class Pin:
    """One client's backend for one model."""

    backend: BackendState
    last_used: float
    #: Sessions and regions the client opened there and has not closed.
    holds: int = 0


@dataclass
class RouteTable:
    """Pins clients to backends; see the module docstring for the rules.

    Args:
        backends: the backends, in the order ties are broken.
        sticky_idle_s: a pin holding no session or region ends after this long without a call.
        clock: monotonic seconds (tests pass their own).
    """

    backends: list[BackendState]
    sticky_idle_s: float = 600.0
    clock: Callable[[], float] = time.monotonic
    _pins: dict[tuple[str, str], Pin] = field(default_factory=dict)

    def pick(self, client: str, model: str) -> BackendState | None:
        """The backend for ``client``'s call for ``model``: its pin while that backend lives and holds the model,
        else the least loaded live backend holding it (pinned from now on); None when no live backend holds it."""
        now = self.clock()
        key = (client, model)
        pin = self._pins.get(key)
        if pin is not None and pin.backend.live and pin.backend.holds(model):
            pin.last_used = now
            return pin.backend
        if pin is not None:
            self._unpin(key)
        self._expire(now)
        candidates = self.holders(model)
        if not candidates:
            return None
        best = min(candidates, key=lambda b: (b.pinned, b.in_flight, b.held_bytes or 0, b.index))
        self._pins[key] = Pin(best, now)
        best.pinned += 1
        return best

    def holders(self, model: str) -> list[BackendState]:
        """Live backends that hold ``model``."""
        return [b for b in self.backends if b.live and b.holds(model)]

    def pinned_to(self, client: str, model: str) -> BackendState | None:
        """The backend ``client`` is pinned to for ``model`` (None: none)."""
        pin = self._pins.get((client, model))
        return None if pin is None else pin.backend

    def opened(self, client: str, model: str) -> None:
        """The client opened a session or a region on its backend: its pin lasts until it closes it."""
        pin = self._pins.get((client, model))
        if pin is not None:
            pin.holds += 1

    def closed(self, client: str, model: str) -> None:
        """The client closed a session or a region."""
        pin = self._pins.get((client, model))
        if pin is not None and pin.holds > 0:
            pin.holds -= 1

    def left(self, client: str, model: str) -> None:
        """The client left the step group: its round is over, and unless it holds a session or a region its next
        call is placed by load again."""
        pin = self._pins.get((client, model))
        if pin is not None and pin.holds == 0:
            self._unpin((client, model))

    def down(self, backend: BackendState) -> int:
        """``backend`` went down: it takes no calls and its clients' pins end; returns how many ended."""
        backend.live = False
        gone = [key for key, pin in self._pins.items() if pin.backend is backend]
        for key in gone:
            self._unpin(key)
        return len(gone)

    def models(self) -> list[str]:
        """Every model a live backend is known to hold."""
        return sorted({m for b in self.backends if b.live for m in b.models if m != ANY_MODEL})

    def clients_of(self, backend: BackendState) -> Iterable[str]:
        """The clients pinned to ``backend``."""
        return [client for (client, _), pin in self._pins.items() if pin.backend is backend]

    def _unpin(self, key: tuple[str, str]) -> None:
        pin = self._pins.pop(key)
        pin.backend.pinned -= 1

    def _expire(self, now: float) -> None:
        idle = [key for key, pin in self._pins.items() if pin.holds == 0 and now - pin.last_used > self.sticky_idle_s]
        for key in idle:
            self._unpin(key)
