"""SplitFed V2 on the trunk (``trunk-mode = "sequential"``): one client's whole local training at a time.

Thapa et al. (AAAI 2022): within a round the one shared trunk trains with the
clients one after another, in a random order each round; each client's
gradients step the trunk at once, as if that client were training alone.

Turns: the server side tells the aggregator the round's participants
(:meth:`SequentialAggregator.begin_round`); their order is a permutation seeded
by ``seed`` and the round (:func:`turn_order`), reproducible for the same client
names (Flower node ids: a simulation draws new ones every run). A client's Join
(or first training Forward) awaits :meth:`SequentialAggregator.turn`, a future
resolved when its turn comes, so a waiting client holds no thread. Its turn ends
when it leaves the step group (Leave at the end of its local training, or a
refused training request), or when it shows no sign of life (Join, training
forward, gradient) for ``timeout`` seconds: a dead or silent client is skipped
and the next one gets the trunk. Nobody is skipped before some client of the
round has been heard from (clients still starting, e.g. Ray actors): a turn that
began earlier counts its timeout from that moment. A skipped client that comes back, or a client
that was not announced, is served after the others.

Concurrency: guarded by the aggregator's lock; futures are resolved under it.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from splitfed.errors import PermissionDeniedError
from splitfed.trunk.aggregation.modes import TrunkAggregator
from splitfed.trunk.aggregation.contributions import Contribution, Result
from splitfed.trunk.compute.requests import Promise

log = logging.getLogger(__name__)


def turn_order(clients: Sequence[str], seed: int, server_round: int) -> list[str]:
    """The round's order: the sorted clients shuffled by a generator seeded by ``seed`` and ``server_round``."""
    order = sorted(set(clients))
    random.Random(f"splitfed-v2:{seed}:{server_round}").shuffle(order)
    return order


class SequentialAggregator(TrunkAggregator):
    """One client at a time on the shared trunk, each gradient applied at once (SplitFed V2).

    Args:
        seed: seeds the per-round order (with the round number).
        timeout: seconds without a sign of life after which the client whose turn it is is skipped.
        clock: monotonic seconds (tests inject one).
    """

    mode = "sequential"

    def __init__(self, *, seed: int = 0, timeout: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(timeout=timeout, clock=clock)
        self.seed = seed
        self.server_round = 0
        #: This round's order, as announced; ``served`` and ``skipped`` say what became of each turn.
        self.order: list[str] = []
        self.served: list[str] = []
        self.skipped: list[str] = []
        self._queue: deque[str] = deque()
        self._waiting: dict[str, Future[None]] = {}
        self._current: str | None = None
        self._since = 0.0
        self._heard = False  # whether any client was heard from since the round began
        self.stats.update({"turns": 0, "skipped-turns": 0})

    @property
    def current(self) -> str | None:
        """The client whose turn it is, if any."""
        with self._lock:
            return self._current

    # -- turns ---------------------------------------------------------------------------
    def begin_round(self, server_round: int, clients: Sequence[str]) -> None:
        """Announce the round's participants: their turns follow :func:`turn_order`."""
        with self._lock:
            if self._current is not None:
                log.warning("sequential: round %d begins while %s still had the trunk; its turn ends",
                            server_round, self._current)
                self._current = None
            self.server_round = server_round
            self.order = turn_order(clients, self.seed, server_round)
            self.served, self.skipped = [], []
            self._heard = False
            late = [c for c in self._queue if c not in self.order]
            self._queue = deque(self.order + late)
            log.info("sequential: round %d order %s", server_round, ", ".join(self.order))
            self._advance()

    def _heard_from(self) -> None:
        """A client showed life: from now on silence counts (caller holds the lock)."""
        if not self._heard:
            self._heard = True
            self._since = self.clock()

    def turn(self, client_id: str) -> Future[None]:
        """A future resolved when ``client_id`` may use the trunk (at once if it is its turn)."""
        with self._lock:
            self._heard_from()
            if client_id == self._current:
                self._since = self.clock()
                done: Future[None] = Promise()
                done.set_result(None)
                return done
            future = self._waiting.get(client_id)
            if future is None or future.done():
                future = Promise()
                self._waiting[client_id] = future
            if client_id not in self._queue:
                self._queue.append(client_id)  # not announced, or skipped earlier: after the others
            self._advance()
            return future

    def _advance(self) -> None:
        """Give the trunk to the next client in line when nobody has it (caller holds the lock)."""
        while self._current is None and self._queue:
            client = self._queue.popleft()
            self._current, self._since = client, self.clock()
            self.stats["turns"] += 1
            log.info("sequential: round %d, %s has the trunk", self.server_round, client)
            future = self._waiting.pop(client, None)
            if future is not None and not future.done():
                future.set_result(None)

    def _end_turn(self, client_id: str, skipped: bool) -> None:
        (self.skipped if skipped else self.served).append(client_id)
        self._current = None
        self._advance()

    # -- signs of life and leaving ------------------------------------------------------------
    def join(self, client_id: str) -> int:
        with self._lock:
            self._heard_from()
            if client_id == self._current:
                self._since = self.clock()
            return super().join(client_id)

    def offer(self, c: Contribution) -> Future[Result]:
        with self._lock:
            self._heard_from()
            if c.client_id == self._current:
                self._since = self.clock()
            return super().offer(c)

    def leave(self, client_id: str) -> int:
        """The client is done (or refused): its turn ends, or it stops waiting for one."""
        with self._lock:
            if client_id == self._current:
                self._end_turn(client_id, skipped=False)
            elif client_id in self._queue:
                self._queue.remove(client_id)
                future = self._waiting.pop(client_id, None)
                if future is not None and not future.done():
                    future.set_exception(PermissionDeniedError(f"{client_id} left the trunk before its turn; "
                                                               "join again to wait for one"))
            return super().leave(client_id)

    def deadline(self) -> float | None:
        with self._lock:
            return None if self._current is None or not self._heard else self._since + self.timeout

    def poll(self) -> None:
        """Skip the client whose turn it is when it has been silent for ``timeout``."""
        with self._lock:
            client = self._current
            if client is None or not self._heard or self.clock() - self._since < self.timeout:
                return
            self.stats["skipped-turns"] += 1
            log.warning("sequential: skipped %s: no sign of life within %.1fs of its turn; the next client gets "
                        "the trunk", client, self.timeout)
            self._members.pop(client, None)
            self._end_turn(client, skipped=True)

    # -- rules ----------------------------------------------------------------------------------
    def ready(self, bucket_clients: set[str], members: set[str]) -> bool:
        return True

    def describe(self) -> str:
        return (f"sequential (SplitFed V2: one client's local training at a time, order seeded by {self.seed} and "
                f"the round; a silent client is skipped after {self.timeout}s)")
