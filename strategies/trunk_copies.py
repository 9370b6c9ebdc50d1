"""SplitFed V1's end of round: a Flower strategy merges the per-client trunk copies into the next global trunk.

The trunk's per-client copies (:mod:`splitfed.trunk.aggregation.percopy`) are handed to the
strategy as if each were a client's train reply: one ArrayRecord with the copy's
trainable weights and a MetricRecord with ``num-examples`` (the examples that
copy trained on). So FedAvg gives the example-weighted mean, FedMedian the
element-wise median, Krum the copy closest to the others, FedAdam a server-side
Adam step from the round's global trunk, each with Flower's own code.

Strategies that keep the round's starting point (FedAdam, FedYogi, FedAdagrad,
FedAvgM: ``current_arrays``) learn it from their ``configure_train``, which
:meth:`TrunkCopies.configure` calls with the global trunk (the messages it
builds are dropped, and Python's ``random`` state is restored, so the client
strategy's node sampling is the same as without it).
"""

from __future__ import annotations

import dataclasses
import random
import time
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, Metadata, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from splitfed.config import RunConfig
from splitfed.trunk.aggregation.percopy import PerClientAggregator, TrainedCopy
from .factory import build_strategy


def build_trunk_strategy(cfg: RunConfig) -> Strategy:
    """The strategy named by ``trunk-strategy`` with ``trunk-strategy-args`` (empty: as ``strategy`` says)."""
    return build_strategy(cfg, trunk=True)


def _node_id(client_id: str, index: int) -> int:
    """The Flower node id of a trunk client named ``node-<id>``, else a stand-in."""
    try:
        return int(client_id.rsplit("-", 1)[-1])
    except ValueError:
        return index + 1


def copy_reply(copy: TrainedCopy, index: int = 0) -> Message:
    """A trunk copy as a train reply: its weights in ``arrays``, its examples in ``metrics``."""
    content = RecordDict({"arrays": ArrayRecord(torch_state_dict=copy.state),
                          "metrics": MetricRecord({"num-examples": copy.num_examples, "trunk-steps": copy.steps})})
    # A reply from the copy's node to the server; built from metadata, so it needs no running ServerApp.
    metadata = Metadata(run_id=0, message_id=f"trunk-copy-{copy.client_id}",
                        src_node_id=_node_id(copy.client_id, index), dst_node_id=0, reply_to_message_id="", group_id="trunk-copies", created_at=time.time(),
                        ttl=3600.0, message_type="train")
    return Message(content=content, metadata=metadata)


class TrunkCopies:
    """Merges the round's trunk copies with a Flower strategy.

    Args:
        strategy: any Flower strategy whose ``aggregate_train`` takes train replies.
    """

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    @staticmethod
    def _copies_of(runtime: Any) -> PerClientAggregator:
        agg = runtime.aggregator
        if not isinstance(agg, PerClientAggregator):
            raise TypeError(f"trunk copies need trunk-mode = 'per-client', the trunk runs {agg.mode!r}")
        return agg

    def configure(self, server_round: int, runtime: Any, grid: Grid) -> None:
        """Let the strategy see the round's global trunk (its ``configure_train``; the messages are dropped)."""
        state = self._copies_of(runtime).global_state()
        saved = random.getstate()
        try:
            list(self.strategy.configure_train(server_round, ArrayRecord(torch_state_dict=state), ConfigRecord(),
                                               grid))
        finally:
            random.setstate(saved)

    def merge(self, server_round: int, runtime: Any) -> dict[str, float]:
        """Take (and free) the round's copies, merge them, load the result into the trunk; returns metrics."""
        copies = self._copies_of(runtime).end_round()
        metrics = {"trunk-copies": float(len(copies)),
                   "trunk-copy-examples": float(sum(c.num_examples for c in copies))}
        if not copies:
            log(WARNING, "round %s: no trunk copy trained; the trunk stays as it was", server_round)
            return metrics
        arrays, _ = self.strategy.aggregate_train(server_round, [copy_reply(c, i) for i, c in enumerate(copies)])
        if arrays is None:
            log(WARNING, "round %s: %s did not merge the trunk copies; the trunk stays as it was", server_round,
                type(self.strategy).__name__)
            return metrics
        merged = arrays.to_torch_state_dict()
        runtime.load_state_dict({"trunk": merged, "version": runtime.version + 1}, strict=False)
        log(INFO, "round %s: %s merged %d trunk copies (%d examples)", server_round, type(self.strategy).__name__,
            len(copies), int(metrics["trunk-copy-examples"]))
        return metrics
