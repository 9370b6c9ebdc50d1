"""Which trunk server serves which model, asked once: what a proxy's generated configuration is built from.

:func:`discover` probes each server the way :class:`~splitfed.channel.routing.router.Router` does (the same
:class:`~splitfed.channel.routing.backends.Backend`): gRPC's health check says whether it lives, its ``Info``
names the model of a server holding one, and each name in ``models`` is asked of every live server's per-model
health service (``<SplitChannel>/<model>``, which a server holding several models reports). The answer is plain
data (:class:`Discovery`); nothing stays open.

Concurrency: one call runs its own event loop (``asyncio.run``) and must not be called from a running loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from splitfed.channel.routing import backends as _backends
from splitfed.channel.routing.backends import Backend
from splitfed.errors import ConfigError


@dataclass(frozen=True)
class Discovery:
    """What the servers answered.

    Attributes:
        backends: every server's address, in the order given.
        live: the addresses that answered their health check SERVING.
        models: each model name with the live servers that serve it, in ``backends``' order.
    """

    backends: tuple[str, ...]
    live: frozenset[str]
    models: dict[str, tuple[str, ...]]

    def describe(self) -> str:
        """One line per model (and the servers that did not answer), for the log."""
        lines = [f"{name}: {', '.join(addrs)}" for name, addrs in sorted(self.models.items())]
        down = [a for a in self.backends if a not in self.live]
        if down:
            lines.append(f"not answering: {', '.join(down)}")
        return "; ".join(lines) or "no model named by any server"


async def _discover(addresses: Sequence[str], models: Iterable[str], credentials: grpc.ChannelCredentials | None,
                    options: Sequence[tuple[str, Any]], timeout_s: float) -> Discovery:
    backends = [Backend(a, i, credentials=credentials, options=options, probe_timeout_s=timeout_s)
                for i, a in enumerate(addresses)]
    try:
        for backend in backends:
            backend.open()
        await asyncio.gather(*(b.probe() for b in backends))
        wanted = sorted(set(models))
        await asyncio.gather(*(b.learn(m) for b in backends if b.state.live for m in wanted))
        held: dict[str, list[str]] = {}
        for backend in backends:
            if backend.state.live:
                for model in sorted(m for m in backend.state.models if m):
                    held.setdefault(model, []).append(backend.address)
        return Discovery(tuple(addresses), frozenset(b.address for b in backends if b.state.live),
                         {m: tuple(a) for m, a in held.items()})
    finally:
        await asyncio.gather(*(b.close() for b in backends), return_exceptions=True)


def discover(addresses: Sequence[str], models: Iterable[str] = (), *,
             credentials: grpc.ChannelCredentials | None = None, options: Sequence[tuple[str, Any]] = (),
             timeout_s: float = 2.0) -> Discovery:
    """Ask each server at ``addresses`` whether it lives and which models it serves (its ``Info``'s, and each of
    ``models`` its per-model health reports SERVING).

    Raises:
        ConfigError: no address, or one listed twice.
    """
    if not addresses:
        raise ConfigError("give at least one trunk server (--backend HOST:PORT)")
    if len(set(addresses)) != len(addresses):
        raise ConfigError(f"a trunk server is listed twice: {list(addresses)}")
    quiet = _BelowWarning()  # a backend "coming up" at every look is no news: the caller logs what changed
    _backends.log.addFilter(quiet)
    try:
        return asyncio.run(_discover(list(addresses), models, credentials, options, timeout_s))
    finally:
        _backends.log.removeFilter(quiet)


class _BelowWarning(logging.Filter):
    """Drops the backends' INFO and DEBUG records while servers are asked."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING
