"""The models a trunk server holds, and their lifecycle: load, unload (draining), reload, list.

Loading runs off the request path: the estimate (config only) on an estimator
thread, the build (reading weights, the optimizer) on a loader thread, one load at
a time; the event loop only awaits them, so listing and the other models' calls
stay fast while a model loads. A load is checked before anything is allocated: a
name already held (ALREADY_EXISTS), a source that is not there (NOT_FOUND), cuts
that do not split it (INVALID_ARGUMENT), an estimate beyond the device's budget
(RESOURCE_EXHAUSTED); a refused load leaves the registry as it was.

States change on the event loop's thread only (the dispatcher reads them there),
and each change is told to ``on_state`` (health, logs). Unloading marks the model
UNLOADING (new calls get UNAVAILABLE), waits for its calls in flight to finish (up
to a drain deadline, after which they end with UNAVAILABLE), closes its sessions,
stops its device thread, closes its regions and forgets it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc

from splitfed.channel.server.dispatch import Refused, going_away
from splitfed.channel.wire.limits import MODEL_KEY
from splitfed.channel.server.units import ModelState, ModelUnit, ServerOptions, release_memory, unit_from_spec
from splitfed.errors import ConfigError, ModelBusyError, ModelExistsError, ModelNotHeldError
from splitfed.serving.devices import check_spec_devices
from splitfed.serving.memory import Estimate, MemoryBudget, estimate
from splitfed.serving.spec import ModelSpec

log = logging.getLogger(__name__)


def _loading(name: str) -> Refused:
    """What a call to a model that is loading (or about to) is told: retry."""
    return Refused(grpc.StatusCode.UNAVAILABLE, f"model {name!r} is loading; retry when `splitfed models list` "
                                                "shows it READY")


@dataclass
class Entry:
    """One model the server holds (or is loading, or failed to load)."""

    name: str
    state: ModelState
    spec: ModelSpec | None = None
    unit: ModelUnit | None = None
    estimate: Estimate | None = None
    error: str = ""
    loaded: asyncio.Future[Any] | None = field(default=None, repr=False)  # set once READY or FAILED


class ModelRegistry:
    """The server's models by name.

    Args:
        options: what every unit shares (limits, token check, region bounds).
        budget: bytes per device models may reserve.
        on_state: told ``(name, state)`` on every change (on the event loop's thread).
        on_ready: told each unit once it is READY (metrics wiring), before calls reach it.
    """

    def __init__(self, options: ServerOptions, budget: MemoryBudget | None = None,
                 on_state: Callable[[str, ModelState | None], Any] | None = None,
                 on_ready: Callable[[ModelUnit], Any] | None = None) -> None:
        self.options = options
        self.budget = budget or MemoryBudget()
        self.on_state = on_state or (lambda name, state: None)
        self.on_ready = on_ready or (lambda unit: None)
        self.entries: dict[str, Entry] = {}
        self._claimed: set[str] = set()  # names whose load is being checked (not listed yet)
        #: Names the server loads once it serves (its start's models), not loading yet: calls for them are told
        #: to retry, not that the server does not hold them.
        self.pending: set[str] = set()
        self._builds: set[asyncio.Task[None]] = set()  # running builds (the loop keeps only weak references)
        self._estimator = ThreadPoolExecutor(2, thread_name_prefix="splitfed-estimate")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="splitfed-loader")

    # -- reading (event loop, or any thread for a snapshot) ---------------------------------------
    def names(self) -> list[str]:
        """The names held, sorted."""
        return sorted(self.entries)

    def _held(self) -> str:
        return ", ".join(repr(n) for n in self.names()) or "none"

    def _coming(self) -> set[str]:
        """Names that will be loaded and are not listed yet."""
        return (self.pending | self._claimed).difference(self.entries)

    def route(self, name: str) -> ModelUnit:
        """The unit a call naming ``name`` ("" for none) goes to, or :class:`Refused` with the status to answer."""
        entries = self.entries
        if not name:
            coming = self._coming()
            if len(entries) + len(coming) != 1:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"this server holds {len(entries) + len(coming)} models ({self._held()}); name one "
                              "with the x-splitfed-model metadata (TrunkClient(..., model=NAME))")
            if coming:
                raise _loading(next(iter(coming)))
            (entry,) = entries.values()
        else:
            got = entries.get(name)
            if got is None:
                if name in self._coming():
                    raise _loading(name)
                raise Refused(grpc.StatusCode.NOT_FOUND, f"this server does not hold model {name!r}; it holds: "
                                                         f"{self._held()}")
            entry = got
        if entry.state is ModelState.READY and entry.unit is not None:
            return entry.unit
        if entry.state is ModelState.LOADING:
            raise _loading(entry.name)
        if entry.state is ModelState.UNLOADING:
            raise Refused(grpc.StatusCode.UNAVAILABLE, going_away(entry.name))
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                      f"model {entry.name!r} failed to load ({entry.error}); reload or unload it")

    def label(self, metadata: dict[str, str]) -> str:
        """The ``model`` label of a call: the name of the model it goes to, "" when it names none held."""
        name = metadata.get(MODEL_KEY, "")
        if name:
            return name if name in self.entries else ""
        entries = self.entries
        return next(iter(entries)) if len(entries) == 1 else ""

    # -- changing (event loop) ----------------------------------------------------------------
    def _set(self, entry: Entry, state: ModelState) -> None:
        entry.state = state
        if entry.unit is not None:
            entry.unit.state = state
        self.on_state(entry.name, state)

    def add(self, unit: ModelUnit) -> None:
        """Hold a unit built in this process (a server made from a trunk module); READY at once."""
        if unit.name in self.entries:
            raise ConfigError(f"this server already holds a model named {unit.name!r}")
        self.entries[unit.name] = Entry(unit.name, ModelState.READY, unit.spec, unit, unit.estimate)
        self.on_ready(unit)
        self.on_state(unit.name, ModelState.READY)

    async def load(self, spec: ModelSpec, *, wait: bool = True) -> Entry:
        """Load ``spec``: checked and its memory reserved now, built on the loader thread.

        With ``wait``, returns once it is READY (or raises what failed); else at once, LOADING.
        """
        name = spec.name
        check_spec_devices([spec])  # before anything is claimed: a refused load leaves nothing behind
        if name in self.entries or name in self._claimed:
            state = self.entries[name].state.value if name in self.entries else "LOADING"
            raise ModelExistsError(f"this server already holds model {name!r} ({state}); unload it first, or "
                                   "reload it")
        self._claimed.add(name)
        loop = asyncio.get_running_loop()
        try:
            est = await loop.run_in_executor(self._estimator, estimate, spec)
            self.budget.reserve(name, est)
        except BaseException:
            self._claimed.discard(name)
            raise
        entry = Entry(name, ModelState.LOADING, spec, estimate=est, loaded=loop.create_future())
        self.entries[name] = entry
        self._claimed.discard(name)
        self.pending.discard(name)
        self.on_state(name, ModelState.LOADING)
        log.info("loading model %s (%s, about %.1f MiB on %s)", name, spec.model, est.total / 2**20, est.device)
        build = asyncio.ensure_future(self._build(entry))
        self._builds.add(build)
        build.add_done_callback(self._builds.discard)
        if wait:
            await self.wait(entry)
        return entry

    async def refuse(self, spec: ModelSpec, reason: str) -> Entry:
        """Hold ``spec`` as FAILED with ``reason``, unloaded: a model of the server's start that was refused (its
        estimate beyond the memory budget) is listed with why while the others serve; a reload loads it once it
        fits."""
        entry = Entry(spec.name, ModelState.FAILED, spec, error=reason)
        self.entries[spec.name] = entry
        self.pending.discard(spec.name)
        self.on_state(spec.name, ModelState.FAILED)
        log.error("model %s refused: %s", spec.name, reason)
        return entry

    async def wait(self, entry: Entry) -> None:
        """Until ``entry`` is READY; raises what failed its load."""
        if entry.loaded is not None:
            await asyncio.shield(entry.loaded)

    async def _build(self, entry: Entry) -> None:
        loop = asyncio.get_running_loop()
        assert entry.spec is not None and entry.loaded is not None
        started = time.perf_counter()
        try:
            unit = await loop.run_in_executor(self._loader, unit_from_spec, entry.spec, self.options, entry.estimate)
            unit.start()
        except BaseException as exc:  # noqa: BLE001 - a failed load is a state, told to whoever waits
            entry.error = f"{type(exc).__name__}: {exc}"
            self.budget.release(entry.name)
            self._set(entry, ModelState.FAILED)
            log.error("loading model %s failed: %s", entry.name, entry.error)
            entry.loaded.set_exception(exc if isinstance(exc, Exception) else RuntimeError(entry.error))
            entry.loaded.exception()  # retrieved: no "never retrieved" warning when nobody waits
            release_memory(entry.spec.device)
            return
        unit.state = ModelState.LOADING
        entry.unit = unit
        self.on_ready(unit)
        self._set(entry, ModelState.READY)
        log.info("model %s is READY (%.1f s)", entry.name, time.perf_counter() - started)
        entry.loaded.set_result(None)

    async def unload(self, name: str, *, drain_timeout_s: float = 30.0) -> Entry:
        """Drain and forget model ``name`` (see the module docstring); returns its last entry."""
        entry = self.entries.get(name)
        if entry is None:
            raise ModelNotHeldError(f"this server does not hold model {name!r}; it holds: {self._held()}")
        if entry.state is ModelState.LOADING:
            raise ModelBusyError(f"model {name!r} is loading; unload it once `splitfed models list` shows it READY "
                                 "or FAILED")
        if entry.state is ModelState.UNLOADING:
            raise ModelBusyError(f"model {name!r} is already being unloaded")
        self._set(entry, ModelState.UNLOADING)
        unit = entry.unit
        if unit is not None:
            deadline = time.monotonic() + max(drain_timeout_s, 0.0)
            while unit.in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            if unit.in_flight:
                log.warning("model %s: %d calls still in flight after %.1f s; ending them", name, unit.in_flight,
                            drain_timeout_s)
                for task in list(unit.calls):
                    task.cancel()
                for _ in range(200):  # they end with UNAVAILABLE at their next await
                    if not unit.in_flight:
                        break
                    await asyncio.sleep(0.01)
            why = f"were closed: model {name!r} was unloaded"
            await asyncio.get_running_loop().run_in_executor(None, unit.close, why)
        del self.entries[name]
        self.budget.release(name)
        entry.unit = None
        self.on_state(name, None)
        if unit is not None:
            device = str(unit.runtime.device)
            del unit
            release_memory(device)
        log.info("model %s unloaded", name)
        return entry

    async def reload(self, name: str, spec: ModelSpec | None = None, *, wait: bool = True,
                     drain_timeout_s: float = 30.0) -> Entry:
        """Unload ``name`` (draining) and load it again from its spec (or ``spec``): fresh weights from its source."""
        entry = self.entries.get(name)
        if entry is None:
            raise ModelNotHeldError(f"this server does not hold model {name!r}; it holds: {self._held()}")
        spec = spec or entry.spec
        if spec is None:
            raise ConfigError(f"model {name!r} was handed to the server in-process, not loaded from a source; "
                              "reload it with a spec (model, cuts, ...)")
        if spec.name != name:
            raise ConfigError(f"a reload keeps the model's name: got a spec for {spec.name!r}, reloading {name!r}")
        check_spec_devices([spec])  # refused before unloading
        await asyncio.get_running_loop().run_in_executor(self._estimator, estimate, spec)
        await self.unload(name, drain_timeout_s=drain_timeout_s)
        return await self.load(spec, wait=wait)

    async def close(self) -> None:
        """Stop every unit (the server stops)."""
        for entry in list(self.entries.values()):
            if entry.loaded is not None and not entry.loaded.done():
                try:
                    await asyncio.wait_for(asyncio.shield(entry.loaded), 60)
                except BaseException:  # noqa: BLE001 - stopping anyway
                    pass
            if entry.unit is not None:
                try:
                    await asyncio.get_running_loop().run_in_executor(None, entry.unit.close, "")
                except RuntimeError:  # at interpreter exit the default executor is already shut down
                    entry.unit.close("")
        self._estimator.shutdown(wait=False, cancel_futures=True)
        self._loader.shutdown(wait=False, cancel_futures=True)

    def close_now(self) -> None:
        """Stop every unit from a thread without the loop (the server never started)."""
        for entry in self.entries.values():
            if entry.unit is not None:
                entry.unit.close("")
        self._estimator.shutdown(wait=False, cancel_futures=True)
        self._loader.shutdown(wait=False, cancel_futures=True)

