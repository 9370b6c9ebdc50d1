"""SplitFed: wraps any Flower strategy so that its rounds drive split learning.

The wrapped strategy (FedAvg, FedProx, FedAdam, Krum, a DP wrapper, or your
own) samples nodes and aggregates the client parts (bottom and top) exactly as
it would a whole model. SplitFed adds what split learning needs around it:
every message gets a ``splitfed`` ConfigRecord with the trunk server's address
and a token for that node and round, replies are checked for the trunk's
counters, and after each round the trunk, the client parts and the history are
checkpointed so a restarted ServerApp resumes from the last completed round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from logging import INFO

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from splitfed.server import ServerRunner

#: Name of the per-node record SplitFed adds to train and evaluate messages.
SPLITFED_RECORD = "splitfed"


class SplitFed(Strategy):
    """A Flower strategy that runs SplitFed rounds around an inner strategy.

    Args:
        strategy: aggregates the client parts (any Flower ``Strategy``).
        runner: the server side of the run (trunk server, tokens, checkpoints).
    """

    def __init__(self, strategy: Strategy, runner: ServerRunner) -> None:
        self.strategy = strategy
        self.runner = runner
        self._offset = runner.round_offset
        self._last_train: MetricRecord | None = None
        self._last_eval: MetricRecord | None = None

    # -- helpers ---------------------------------------------------------------------------------
    def _round(self, server_round: int) -> int:
        """The run's round number (rounds continue after a resume)."""
        return server_round + self._offset

    def _with_trunk(self, messages: Iterable[Message], server_round: int) -> list[Message]:
        out = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            content = RecordDict(dict(msg.content.items()))
            content[SPLITFED_RECORD] = ConfigRecord(self.runner.trunk_config(node, server_round))
            out.append(Message(content=content, dst_node_id=node, message_type=msg.metadata.message_type,
                               group_id=msg.metadata.group_id or None))
        return out

    # -- Strategy hooks -----------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                        ) -> Iterable[Message]:
        """The inner strategy's train messages, each with the trunk's address and a fresh token."""
        run_round = self._round(server_round)
        messages = self.strategy.configure_train(run_round, arrays, config, grid)
        return self._with_trunk(messages, run_round)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The inner strategy aggregates the client parts; the trunk's counters join the metrics."""
        arrays, metrics = self.strategy.aggregate_train(self._round(server_round), replies)
        metrics = MetricRecord({**(dict(metrics) if metrics is not None else {}), **self.runner.trunk_metrics()})
        self._last_train = metrics
        return arrays, metrics

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                           ) -> Iterable[Message]:
        """The inner strategy's evaluate messages, each with the trunk's address and a token."""
        run_round = self._round(server_round)
        return self._with_trunk(self.strategy.configure_evaluate(run_round, arrays, config, grid), run_round)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The inner strategy aggregates the evaluation metrics."""
        metrics = self.strategy.aggregate_evaluate(self._round(server_round), replies)
        self._last_eval = metrics
        return metrics

    def summary(self) -> None:
        """Log the inner strategy's settings and the trunk's."""
        log(INFO, "\t├──> SplitFed around %s", type(self.strategy).__name__)
        log(INFO, "\t│\t├── Model: %s cut at %s", self.runner.cfg.model, self.runner.cuts)
        log(INFO, "\t│\t├── Trunk: %s at %s", self.runner.runtime.aggregator.describe(),
            self.runner.advertised_address)
        log(INFO, "\t│\t└── Auth: %s, output: %s", "tokens" if self.runner.tokens else "off", self.runner.output_dir)
        self.strategy.summary()

    # -- rounds -----------------------------------------------------------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Flower's round loop; after every round the runner checkpoints trunk, client parts and history."""

        def end_of_round(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            central = evaluate_fn(self._round(server_round), arrays) if evaluate_fn is not None else None
            if server_round > 0:
                self.runner.end_round(self._round(server_round), arrays.to_torch_state_dict(),
                                      dict(self._last_train or {}), dict(self._last_eval or {}))
            return central

        return super().start(grid, initial_arrays, num_rounds=num_rounds, timeout=timeout, train_config=train_config,
                             evaluate_config=evaluate_config, evaluate_fn=end_of_round)
