"""Batched decoding: the decode steps of several inference sessions as one trunk call (continuous batching).

Each session keeps its own KV cache (:mod:`splitfed.trunk.sessions`). When
several sessions send a one-position step within the scheduler's batching
window, their caches are stacked into one :class:`DecodeGroup`: every layer's
keys and values are concatenated along the batch, each session's rows
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
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from splitfed.split.base import CutState
from splitfed.trunk.recompute import busy_on_oom

if TYPE_CHECKING:
    from splitfed.trunk.runtime import TrunkRuntime
    from splitfed.trunk.sessions import Session

log = logging.getLogger(__name__)

_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)


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
        if type(layer) not in _LAYERS or not layer.is_initialized or getattr(layer, "record_past", False):
            return False
    return True


def _stored(layer: Any, seen: int) -> int:
    """Positions a cache layer keeps after seeing ``seen`` (a sliding window keeps the last ``window - 1``)."""
    if isinstance(layer, DynamicSlidingWindowLayer):
        return min(seen, layer.sliding_window - 1)
    return seen


def _fill(layer: Any, keys: torch.Tensor, values: torch.Tensor, seen: int) -> None:
    """Set an empty cache layer to hold ``keys``/``values`` after having seen ``seen`` positions."""
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    if isinstance(layer, DynamicSlidingWindowLayer):
        layer.cumulative_length = seen


def _left_pad(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - t.shape[dim]
    if not missing:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class DecodeGroup:
    """Sessions decoding together: their caches stacked along the batch, left-padded to one length.

    Build it with :meth:`stack`; while it lives, its members' own ``cache`` is
    None and their ``group`` is this group. :meth:`dissolve` gives every member
    its cache back.

    A member may sit a step out (its client was late for the window): the group
    steps anyway, that member's rows get a masked-out filler position, and the
    group remembers which columns are real for each member (``valid``). So a
    straggler costs no restacking. Groups with sliding-window layers never skip
    members (a hole would shift their window); they are restacked instead.
    """

    def __init__(self, trunk: Any, members: list[Session]) -> None:
        self.members = members
        self._trunk = trunk
        self.length = max(s.length for s in members)  # positions of the padded layout
        starts = [0]
        for s in members:
            starts.append(starts[-1] + s.batch_size)
        self.rows = [slice(a, b) for a, b in itertools.pairwise(starts)]
        self.cache = trunk.new_cache()
        self.sliding = any(isinstance(layer, DynamicSlidingWindowLayer) for layer in self.cache.layers)
        for i, layer in enumerate(self.cache.layers):
            width = _stored(layer, self.length)
            parts = [s.cache.layers[i] for s in members]
            keys = torch.cat([_left_pad(p.keys, width, 2) for p in parts])
            values = torch.cat([_left_pad(p.values, width, 2) for p in parts])
            _fill(layer, keys, values, self.length)
        #: (members, positions): which of the group's positions are each member's own (left padding and skipped
        #: steps are not)
        self.valid = torch.arange(self.length) >= torch.tensor([self.length - s.length for s in members])[:, None]
        self._member_of_row = torch.repeat_interleave(torch.arange(len(members)),
                                                      torch.tensor([s.batch_size for s in members]))
        self.missed = [0] * len(members)  # steps each member sat out in a row

    @classmethod
    def stack(cls, trunk: Any, members: list[Session]) -> DecodeGroup:
        """Stack the members' caches (dissolving any group they are in) into a new group."""
        for s in members:
            if s.group is not None:
                s.group.dissolve()
        group = cls(trunk, members)
        for s in members:
            s.cache, s.group = None, group
        log.debug("stacked %d sessions for batched decoding (%d padded positions)", len(members), group.length)
        return group

    @property
    def session_ids(self) -> tuple[str, ...]:
        """Members' ids, in row order."""
        return tuple(s.session_id for s in self.members)

    def can_skip(self, present: set[str], max_missed: int) -> bool:
        """Whether the group may step with only ``present`` members (the others skip one step)."""
        if len(present) == len(self.members):
            return True
        if self.sliding:
            return False
        longest = max(s.length for s in self.members)
        return (self.length < 2 * longest + 64 and
                all(m + 1 <= max_missed for s, m in zip(self.members, self.missed) if s.session_id not in present))

    def dissolve(self) -> None:
        """Give every member its own cache back (its rows, its real positions) and end the group."""
        if not self.members:
            return
        for s, rows, valid in zip(self.members, self.rows, self.valid):
            cache = self._trunk.new_cache()
            tail = bool(valid[self.length - s.length:].all())  # no skipped steps: its positions are the last ones
            for layer, mine in zip(self.cache.layers, cache.layers):
                if tail:
                    keep = _stored(mine, s.length)
                    # clone: a view would keep the whole stacked tensor alive
                    keys = layer.keys[rows, :, layer.keys.shape[2] - keep:].clone()
                    values = layer.values[rows, :, layer.values.shape[2] - keep:].clone()
                else:  # full-attention layers only (sliding groups never skip)
                    cols = valid.nonzero().squeeze(1).to(layer.keys.device)
                    keys = layer.keys[rows].index_select(2, cols)
                    values = layer.values[rows].index_select(2, cols)
                _fill(mine, keys, values, s.length)
            s.cache, s.group = cache, None
        log.debug("dissolved a decode group of %d sessions", len(self.members))
        self.members, self.rows, self.missed, self.cache = [], [], [], None
        self.valid = self.valid[:0]

    def inputs(self, states: list[CutState | None]) -> CutState:
        """One batched state from the members' steps (member order; None: that member sits this step out).

        A present member's mask is laid onto its own positions (0 elsewhere),
        with its position ids (by default, as alone: its length onwards). An
        absent member's rows get a zero filler that attends to its own past and
        that no later step sees.
        """
        first = next(st for st in states if st is not None)
        new, width, dtype = first.hidden.shape[1], first.hidden.shape[2], first.hidden.dtype
        if all(st is not None and st.attention_mask is None and st.position_ids is None for st in states):
            return self._plain_inputs([st.hidden for st in states], new, dtype)  # type: ignore[union-attr]
        hidden, masks, positions = [], [], []
        for s, st, valid in zip(self.members, states, self.valid):
            b = s.batch_size
            mask = torch.zeros(b, self.length + new, dtype=torch.bool)
            if st is None:
                hidden.append(torch.zeros(b, new, width, dtype=dtype))
                mask[:, : self.length] = valid
                positions.append(torch.zeros(b, new, dtype=torch.long))
            else:
                hidden.append(st.hidden.to(dtype))
                if st.attention_mask is None:
                    mask[:, : self.length] = valid
                    mask[:, self.length:] = True
                else:
                    own = st.attention_mask.to(torch.bool)
                    mask[:, : self.length][:, valid] = own[:, : s.length]
                    mask[:, self.length:] = own[:, s.length:]
                pos = st.position_ids
                if pos is None:  # what the trunk uses alone: the cache's length onwards
                    pos = torch.arange(s.length, s.length + new).unsqueeze(0)
                positions.append(pos.expand(b, -1).to(torch.long))
            masks.append(mask)
        return CutState(torch.cat(hidden), torch.cat(masks), torch.cat(positions))

    def _plain_inputs(self, hidden: list[torch.Tensor], new: int, dtype: torch.dtype) -> CutState:
        """Every member present with neither mask nor positions (what unpadded generation sends): a few whole-batch
        operations instead of a few per member."""
        rows = int(self._member_of_row.shape[0])
        mask = torch.ones(rows, self.length + new, dtype=torch.bool)
        mask[:, : self.length] = self.valid.index_select(0, self._member_of_row)
        lengths = torch.tensor([s.length for s in self.members]).index_select(0, self._member_of_row)
        positions = lengths[:, None] + torch.arange(new)
        return CutState(torch.cat([h.to(dtype) for h in hidden]), mask, positions)

    def advance(self, present: list[bool], new: int) -> None:
        """Record a step: ``new`` more positions, real for the present members."""
        self.length += new
        self.valid = torch.cat([self.valid, torch.tensor(present)[:, None].expand(-1, new)], dim=1)
        self.missed = [0 if p else m + 1 for m, p in zip(self.missed, present)]


def run_group(runtime: TrunkRuntime, group: DecodeGroup, states: list[CutState | None]) -> torch.Tensor:
    """One trunk call for the group's step (``states`` in member order, None for a member sitting it out).

    Returns the batched output. The caller advances each member's ``length``
    afterwards. Runs under the runtime's lock with the trunk in eval mode, as a
    single session's step does.
    """
    rt = runtime
    with rt._lock:
        inputs, _ = rt._prepare(group.inputs(states), train=False)
        with evaluating(rt.trunk), torch.no_grad(), rt._autocast(), busy_on_oom("batched decode step"):
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

    ``manager`` is the :class:`~splitfed.trunk.sessions.SessionManager` that
    holds the sessions. Results come in ``steps`` order, outputs as the runtime
    hands them (:meth:`TrunkRuntime.handed`); each step gets its own error.
    """
    rt = manager.runtime
    out: list[Outcome] = [None] * len(steps)
    chosen: list[tuple[int, Session]] = []
    alone: list[int] = []
    for i, st in enumerate(steps):
        try:
            session = manager._touch(st.client_id, st.session_id)
        except Exception as exc:  # noqa: BLE001 - that step's own error
            out[i] = exc
            continue
        h = st.state.hidden
        if (h.dim() != 3 or h.shape[1] != 1 or any(s is session for _, s in chosen)
                or not stackable(session)):
            alone.append(i)
        else:
            chosen.append((i, session))
    batched: list[tuple[int, Session]] = []
    # a lone step batches only with the group it is in (its other members sit the step out)
    if len(chosen) >= 2 or (chosen and chosen[0][1].group is not None):
        with lock_all(_with_group_members([s for _, s in chosen])):
            ready = []
            for i, s in chosen:
                try:
                    repeated = manager._admit(s, steps[i].state, steps[i].step_id)
                except Exception as exc:  # noqa: BLE001
                    out[i] = exc
                    continue
                if repeated is not None:
                    out[i] = rt.handed(repeated)
                else:
                    ready.append((i, s))
            group = _plan(manager, ready)
            if group is not None:
                _run_batched(manager, group, steps, ready, out)
                batched = [(i, s) for i, s in ready if not isinstance(out[i], BaseException)]
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
    if len(members) < 2:
        return None
    manager.stats["decode_groups"] += 1
    return DecodeGroup.stack(manager.runtime.trunk, members)


def _run_batched(manager: Any, group: DecodeGroup, steps: list[SessionStep], ready: list[tuple[int, Session]],
                 out: list[Outcome]) -> None:
    """The batched call (every session's step lock held); each present member's output goes to its step."""
    rt = manager.runtime
    index = {s.session_id: i for i, s in ready}
    states = [steps[index[s.session_id]].state if s.session_id in index else None for s in group.members]
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
    manager.stats["decode_batches"] += 1
    manager.stats["batched_steps"] += len(ready)
