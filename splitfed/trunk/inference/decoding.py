"""Batched decoding: the decode steps of several inference sessions as one trunk call (continuous batching).

Each session keeps its own KV cache (:mod:`splitfed.trunk.inference.sessions`). When
several sessions send a one-position step within the scheduler's batching
window, their caches are stacked into one
:class:`~splitfed.trunk.inference.decodegroup.DecodeGroup`: every layer's keys and values are concatenated along the batch, each session's rows
LEFT-padded with zeros to the longest session, so that every row's newest
position sits in the same column. The batched step gets a 2-D mask that is 0 on
that padding (and on each session's own padding), and each row's own position
ids, so a row attends to exactly the keys it would attend to alone; its output
equals the unbatched step's up to float rounding.

The group stays stacked between steps: while the same sessions keep decoding
together, a step costs one trunk call and no copying. When the set changes (a
session joins, leaves, closes, is evicted or steps alone, e.g. a prefill) the
group is dissolved: each session gets its own cache back, its padding cut off,
and the next batched step stacks a new group. Full-attention (``DynamicLayer``)
and sliding-window (``DynamicSlidingWindowLayer``) cache layers are supported;
sessions with other cache layers step one by one.

The first steps (prefills) of several sessions in one window run as one call as well
(:mod:`splitfed.trunk.inference.prefill`); the sessions then decode in a group.

The window (:class:`~splitfed.trunk.scheduler.TrunkScheduler`): it closes as
soon as it holds a step of every session that is decoding
(:meth:`SessionManager.complete <splitfed.trunk.inference.sessions.SessionManager.complete>`),
else ``batch_window_ms`` after the latest step joined it, and never later than
:data:`~splitfed.trunk.scheduler.ITEM_WINDOW_BOUND` windows after the first. A
session that stops sending steps is waited for in at most :data:`MAX_MISSED`
windows.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from splitfed.split.base import CutState
from splitfed.trunk.inference.decodegroup import STACKABLE_LAYERS, DecodeGroup
from splitfed.trunk.compute.recompute import busy_on_oom
from splitfed.trunk.inference.fixedsteps import attach
from splitfed.trunk.inference.prefill import batchable, is_prefill, prefill_key, run_prefills

if TYPE_CHECKING:
    from splitfed.trunk.compute.runtime import TrunkRuntime
    from splitfed.trunk.inference.sessions import Session

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionStep:
    """One Forward of an inference session, as the scheduler queues it."""

    client_id: str
    session_id: str
    state: CutState
    step_id: str = ""

    @property
    def tokens(self) -> int:
        """Positions this step computes (batch x new positions)."""
        h = self.state.hidden
        return int(h.shape[0] * h.shape[1]) if h.dim() == 3 else 1


def stackable(session: Session) -> bool:
    """Whether ``session``'s cache can join a :class:`DecodeGroup` (it holds a past in supported layers)."""
    if session.group is not None:
        return True
    layers = getattr(session.cache, "layers", None)
    if session.length < 1 or not layers:
        return False
    for layer in layers:
        if type(layer) not in STACKABLE_LAYERS or not layer.is_initialized or getattr(layer, "record_past", False):
            return False
    return True


def run_group(runtime: TrunkRuntime, group: DecodeGroup, states: list[CutState | None]) -> torch.Tensor:
    """One trunk call for the group's step (``states`` in member order, None for a member sitting it out).

    Returns the batched output. The caller advances each member's ``length``
    afterwards. Runs under the runtime's lock with the trunk in eval mode, as a
    single session's step does.
    """
    rt = runtime
    with rt._lock:
        if group.fixed is not None:  # over a fixed-size cache, as a CUDA graph on a GPU (:mod:`.fixedsteps`)
            with busy_on_oom("batched decode step"):
                out = group.fixed.step(group.inputs(states))
        else:
            inputs, _ = rt._prepare(group.inputs(states), train=False)
            with evaluating(rt.trunk), torch.no_grad(), rt._autocast(), rt._stepwise(), \
                    busy_on_oom("batched decode step"):
                out = rt.trunk(inputs, cache=group.cache, use_cache=True).hidden
    new = next(st for st in states if st is not None).hidden.shape[1]
    group.advance([st is not None for st in states], new)
    return out


@contextlib.contextmanager
def evaluating(trunk: nn.Module) -> Iterator[None]:
    """``trunk`` in eval mode (no dropout) for the block, as it was afterwards.

    Only the modules in training mode have their flag switched: ``trunk.eval()`` and ``trunk.train()`` walk
    every module twice per call, which on a decode step of a small trunk is host time the size of a layer's
    forward. A trunk with a module that overrides ``train()`` gets the real calls.
    """
    if not trunk.training:
        yield
        return
    modules = list(trunk.modules())
    if any(type(m).train is not nn.Module.train for m in modules):
        trunk.eval()
        try:
            yield
        finally:
            trunk.train()
        return
    switched = [m for m in modules if m.training]
    for m in switched:
        m.training = False
    try:
        yield
    finally:
        for m in switched:
            m.training = True


def lock_all(sessions: list[Session]) -> contextlib.ExitStack:
    """Hold every session's step lock (in the given order) until the returned stack closes."""
    stack = contextlib.ExitStack()
    for s in sessions:
        stack.enter_context(s.lock)
    return stack


Outcome = Any  # a step's output tensor, or the exception that step gets

#: steps in a row a member of a group may sit out before the group is restacked without it
MAX_MISSED = 4


def step_many(manager: Any, steps: list[SessionStep]) -> list[Outcome]:
    """Run several sessions' steps: one-position steps of distinct sessions as one batched call, the rest alone.

    ``manager`` is the :class:`~splitfed.trunk.inference.sessions.SessionManager` that
    holds the sessions. Results come in ``steps`` order, outputs as the runtime
    hands them (:meth:`TrunkRuntime.handed`); each step gets its own error.
    """
    rt = manager.runtime
    out: list[Outcome] = [None] * len(steps)
    chosen: list[tuple[int, Session]] = []
    prefills: list[tuple[int, Session]] = []
    alone: list[int] = []
    seen: set[int] = set()
    for i, st in enumerate(steps):
        try:
            session = manager._touch(st.client_id, st.session_id)
        except Exception as exc:  # noqa: BLE001 - that step's own error
            out[i] = exc
            continue
        h = st.state.hidden
        if id(session) in seen:  # a session's second step in the window runs after its first, alone
            alone.append(i)
        elif is_prefill(session, st.state):
            prefills.append((i, session))
        elif h.dim() == 3 and h.shape[1] == 1 and stackable(session):
            chosen.append((i, session))
        else:
            alone.append(i)
        seen.add(id(session))
    batched: list[tuple[int, Session]] = _prefill_batches(manager, steps, prefills, out, alone)
    # a lone step batches only with the group it is in (its other members sit the step out), or alone as a group
    # of one where groups take fixed steps (a CUDA graph for its decode step)
    if len(chosen) >= 2 or (chosen and (chosen[0][1].group is not None or manager.fixed_steps)):
        with lock_all(_with_group_members([s for _, s in chosen])):
            ready = _admitted(manager, steps, chosen, out)
            group = _plan(manager, ready)
            if group is not None:
                _run_batched(manager, group, steps, ready, out)
                batched += [(i, s) for i, s in ready if not isinstance(out[i], BaseException)]
            else:
                alone.extend(i for i, _ in ready)
    else:
        alone.extend(i for i, _ in chosen)
    for i, s in batched:
        try:
            manager._settle(s)
        except Exception as exc:  # noqa: BLE001
            out[i] = exc
    for i in sorted(alone):
        st = steps[i]
        try:
            out[i] = rt.handed(manager.step(st.client_id, st.session_id, st.state, step_id=st.step_id))
        except Exception as exc:  # noqa: BLE001
            out[i] = exc
    return out


def _admitted(manager: Any, steps: list[SessionStep], picks: list[tuple[int, Session]],
              out: list[Outcome]) -> list[tuple[int, Session]]:
    """The picked steps that are new (their session locks held): a retry is answered from its session's last
    step and a rejected step gets its error, in ``out``."""
    ready = []
    for i, s in picks:
        try:
            repeated = manager._admit(s, steps[i].state, steps[i].step_id)
        except Exception as exc:  # noqa: BLE001 - that step's own error
            out[i] = exc
            continue
        if repeated is not None:
            out[i] = manager.runtime.handed(repeated)
        else:
            ready.append((i, s))
    return ready


def _prefill_batches(manager: Any, steps: list[SessionStep], prefills: list[tuple[int, Session]],
                     out: list[Outcome], alone: list[int]) -> list[tuple[int, Session]]:
    """Run the window's prefills of equal width and dtype as one call each (:mod:`.prefill`).

    Returns the steps that ran (to settle); a prefill that cannot batch goes to ``alone``.
    """
    rt = manager.runtime
    by_key: dict[Any, list[tuple[int, Session]]] = {}
    for i, s in prefills:
        by_key.setdefault(prefill_key(steps[i].state), []).append((i, s))
    done: list[tuple[int, Session]] = []
    for members in by_key.values():
        longest = max(int(steps[i].state.hidden.shape[1]) for i, _ in members)
        if len(members) < 2 or not all(batchable(s.cache, longest) for _, s in members):
            alone.extend(i for i, _ in members)
            continue
        with lock_all([s for _, s in members]):
            ready = []
            for i, s in _admitted(manager, steps, members, out):
                if is_prefill(s, steps[i].state):
                    ready.append((i, s))
                else:  # another window stepped it meanwhile
                    alone.append(i)
            if len(ready) < 2:
                alone.extend(i for i, _ in ready)
                continue
            try:
                parts = run_prefills(rt, [s for _, s in ready], [steps[i].state for i, _ in ready])
            except Exception as exc:  # noqa: BLE001 - nothing was kept: every session is still empty
                log.warning("a batched prefill of %d sessions failed: %s", len(ready), exc)
                for i, _ in ready:
                    out[i] = exc
                continue
            for (i, s), part in zip(ready, parts):
                manager._advance(s, steps[i].state, steps[i].step_id, part)
                out[i] = part
        done.extend(ready)
        with manager._lock:
            manager.stats["prefill_batches"] += 1
            manager.stats["batched_prefills"] += len(ready)
    return done


def _with_group_members(sessions: list[Session]) -> list[Session]:
    """``sessions`` and the other members of their groups (their caches may move): each once, in order."""
    out: dict[str, Session] = {}
    for s in sessions:
        for m in ([s] + (s.group.members if s.group is not None else [])):
            out.setdefault(m.session_id, m)
    return list(out.values())


def _plan(manager: Any, ready: list[tuple[int, Session]]) -> DecodeGroup | None:
    """The group to step ``ready`` in: their current group, or a new stack (None: step alone)."""
    if not ready:
        return None
    sessions = [s for _, s in ready]
    present = {s.session_id for s in sessions}
    group = sessions[0].group
    if group is not None and all(s.group is group for s in sessions) and group.can_skip(present, MAX_MISSED):
        return group
    # restack: the steps' sessions, and (when holes are allowed) the members of their groups that are merely late
    late: dict[str, Session] = {}
    for s in sessions:
        g = s.group
        if g is not None and not g.sliding:
            for m, missed in zip(g.members, g.missed):
                if m.session_id not in present and missed + 1 <= MAX_MISSED and m.length <= 2 * max(
                        x.length for x in sessions) + 64:
                    late.setdefault(m.session_id, m)
    members = sessions + list(late.values())
    if len(members) < 2 and not manager.fixed_steps:
        return None
    if len(members) > 1:
        manager.stats["decode_groups"] += 1
    group = DecodeGroup.stack(manager.runtime.trunk, members)
    attach(manager.runtime, group, manager.decode_steps)
    return group


def _run_batched(manager: Any, group: DecodeGroup, steps: list[SessionStep], ready: list[tuple[int, Session]],
                 out: list[Outcome]) -> None:
    """The batched call (every session's step lock held); each present member's output goes to its step."""
    rt = manager.runtime
    index = {s.session_id: i for i, s in ready}
    states = [steps[index[s.session_id]].state if s.session_id in index else None for s in group.members]
    fixed = group.fixed
    captures = fixed.captures if fixed is not None else 0
    try:
        hidden = rt.handed(run_group(rt, group, states))
    except Exception as exc:  # noqa: BLE001 - the caches may hold part of the step: drop the group's sessions
        log.warning("a batched decode step of %d sessions failed (%s); dropping them", len(group.members), exc)
        with manager._lock:
            for s in list(group.members):
                manager._end(s.session_id, f"was dropped after a failed batched step ({exc}); open a new one")
        for i, _ in ready:
            out[i] = exc
        return
    for s, rows in zip(group.members, group.rows):
        i = index.get(s.session_id)
        if i is None:
            continue
        part = hidden[rows]
        manager._advance(s, steps[i].state, steps[i].step_id, part)
        out[i] = part
    if len(group.members) > 1:
        manager.stats["decode_batches"] += 1
        manager.stats["batched_steps"] += len(ready)
    if fixed is not None:
        manager.stats["fixed_steps"] += len(ready)
        manager.stats["graph_captures"] += fixed.captures - captures
        if fixed.capture_failed:
            manager.decode_steps = "fixed"
