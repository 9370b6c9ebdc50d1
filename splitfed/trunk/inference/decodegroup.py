"""A decode group: several inference sessions' KV caches stacked along the batch, left-padded to one length.

Every layer's keys and values are concatenated along the batch, each session's
rows LEFT-padded with zeros to the longest session, so that every row's newest
position sits in the same column. A batched step gets a 2-D mask that is 0 on
that padding (and on each session's own padding, and on the filler positions of
members that sat a step out), and each row's own position ids, so a row attends
to exactly the keys it would attend to alone. :mod:`splitfed.trunk.inference.decoding`
decides when groups form, step and dissolve.
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from splitfed.split.base import CutState

if TYPE_CHECKING:
    from splitfed.trunk.inference.sessions import Session

log = logging.getLogger(__name__)

#: cache layers a group can stack
STACKABLE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)


def stored_positions(layer: Any, seen: int) -> int:
    """Positions a cache layer keeps after seeing ``seen`` (a sliding window keeps the last ``window - 1``)."""
    if isinstance(layer, DynamicSlidingWindowLayer):
        return min(seen, layer.sliding_window - 1)
    return seen


def fill_layer(layer: Any, keys: torch.Tensor, values: torch.Tensor, seen: int) -> None:
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
            width = stored_positions(layer, self.length)
            parts = [s.cache.layers[i] for s in members]
            keys = torch.cat([_left_pad(p.keys, width, 2) for p in parts])
            values = torch.cat([_left_pad(p.values, width, 2) for p in parts])
            fill_layer(layer, keys, values, self.length)
        #: (members, positions): which of the group's positions are each member's own (left padding and skipped
        #: steps are not)
        self.valid = torch.arange(self.length) >= torch.tensor([self.length - s.length for s in members])[:, None]
        self._member_of_row = torch.repeat_interleave(torch.arange(len(members)),
                                                      torch.tensor([s.batch_size for s in members]))
        self.missed = [0] * len(members)  # steps each member sat out in a row
        #: the group's steps over a fixed-size cache (:mod:`splitfed.trunk.inference.fixedsteps`), when it has them
        self.fixed: Any = None

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
                    keep = stored_positions(mine, s.length)
                    end = min(layer.keys.shape[2], self.length)  # a fixed-size cache holds room past its length
                    # clone: a view would keep the whole stacked tensor alive
                    keys = layer.keys[rows, :, end - keep:end].clone()
                    values = layer.values[rows, :, end - keep:end].clone()
                else:  # full-attention layers only (sliding groups never skip)
                    cols = valid.nonzero().squeeze(1).to(layer.keys.device)
                    keys = layer.keys[rows].index_select(2, cols)
                    values = layer.values[rows].index_select(2, cols)
                fill_layer(mine, keys, values, s.length)
            s.cache, s.group = cache, None
        log.debug("dissolved a decode group of %d sessions", len(self.members))
        self.members, self.rows, self.missed, self.cache, self.fixed = [], [], [], None, None
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
        device = first.hidden.device  # a step's hidden may arrive on the trunk's GPU (a region with CUDA events)
        if all(st is not None and st.attention_mask is None and st.position_ids is None for st in states):
            return self._plain_inputs([st.hidden for st in states], new, dtype)  # type: ignore[union-attr]
        hidden, masks, positions = [], [], []
        for s, st, valid in zip(self.members, states, self.valid):
            b = s.batch_size
            mask = torch.zeros(b, self.length + new, dtype=torch.bool)
            if st is None:
                hidden.append(torch.zeros(b, new, width, dtype=dtype, device=device))
                mask[:, : self.length] = valid
                positions.append(torch.zeros(b, new, dtype=torch.long))
            else:
                hidden.append(st.hidden.to(device=device, dtype=dtype))
                if st.attention_mask is None:
                    mask[:, : self.length] = valid
                    mask[:, self.length:] = True
                else:
                    own = st.attention_mask.to(device="cpu", dtype=torch.bool)
                    mask[:, : self.length][:, valid] = own[:, : s.length]
                    mask[:, self.length:] = own[:, s.length:]
                pos = st.position_ids
                if pos is None:  # what the trunk uses alone: the cache's length onwards
                    pos = torch.arange(s.length, s.length + new).unsqueeze(0)
                positions.append(pos.expand(b, -1).to(device="cpu", dtype=torch.long))
            masks.append(mask)
        # mask and positions are built on the host (small); the runtime places them with the hidden state
        return CutState(torch.cat(hidden), torch.cat(masks), torch.cat(positions))

    def _plain_inputs(self, hidden: list[torch.Tensor], new: int, dtype: torch.dtype) -> CutState:
        """Every member present with neither mask nor positions (what unpadded generation sends): a few whole-batch
        operations instead of a few per member."""
        rows = int(self._member_of_row.shape[0])
        mask = torch.ones(rows, self.length + new, dtype=torch.bool)
        mask[:, : self.length] = self.valid.index_select(0, self._member_of_row)
        lengths = torch.tensor([s.length for s in self.members]).index_select(0, self._member_of_row)
        positions = lengths[:, None] + torch.arange(new)
        device = hidden[0].device
        return CutState(torch.cat([h.to(device=device, dtype=dtype) for h in hidden]), mask, positions)

    def advance(self, present: list[bool], new: int) -> None:
        """Record a step: ``new`` more positions, real for the present members."""
        self.length += new
        self.valid = torch.cat([self.valid, torch.tensor(present)[:, None].expand(-1, new)], dim=1)
        self.missed = [0 if p else m + 1 for m, p in zip(self.missed, present)]
