"""Heterogeneous cuts in the Flower rounds: whole-model replies for the strategy, the trunk's share back.

Before the inner strategy aggregates a round, each client's reply is completed
with the trunk's copy of the blocks the trunk ran for it (its ``splitfed-cut``
record says which), so the strategy sees whole models and merges every block
by the rule of :mod:`splitfed.split.cutmerge`. After it, the trunk loads its blocks
from the aggregate, so every holder starts the next round from the same version.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ArrayRecord, Message

from splitfed.split.cutmerge import complete_state
from splitfed.errors import ConfigError
from splitfed.models.hetero import load_trunk_blocks, trunk_blocks
from splitfed.run.messages import CUT_END, CUT_RECORD, CUT_START
from splitfed.trunk.compute.runtime import TrunkRuntime


def reply_cut(reply: Message) -> tuple[int, int]:
    """The cut a client trained with, from its reply's ``splitfed-cut`` record."""
    records = reply.content.config_records
    if CUT_RECORD not in records:
        raise ConfigError(f"node {reply.metadata.src_node_id}'s train reply has no {CUT_RECORD!r} record: in a run "
                          "with client-cuts every ClientApp must be this version of splitfed")
    record = records[CUT_RECORD]
    return int(record[CUT_START]), int(record[CUT_END])  # type: ignore[arg-type]


def complete_replies(replies: Iterable[Message], runtime: TrunkRuntime) -> None:
    """Replace each reply's arrays by its client parts plus the trunk's copy of blocks ``[a, b)`` (in place)."""
    for reply in replies:
        a, b = reply_cut(reply)
        own = reply.content["arrays"].to_torch_state_dict()
        reply.content["arrays"] = ArrayRecord(torch_state_dict=complete_state(own, trunk_blocks(runtime, a, b)))


def load_trunk(arrays: ArrayRecord | None, runtime: TrunkRuntime) -> None:
    """Give the trunk the aggregate's version of its blocks."""
    if arrays is not None:
        load_trunk_blocks(runtime, arrays.to_torch_state_dict())
