"""SplitFed: wraps any Flower strategy so that its rounds drive split learning.

The wrapped strategy (FedAvg, FedProx, FedAdam, Krum, a DP wrapper, or your
own) samples nodes and aggregates the client parts (bottom and top) exactly as
it would a whole model. SplitFed adds what split learning needs around it:
every message's ConfigRecord gets ``splitfed.``-prefixed keys with the trunk
server's address and a token for that node and round (still one ConfigRecord, as
Flower's mods want), replies are checked for the trunk's counters, and after each round the trunk, the client parts, the inner
strategy's state, the clients' privacy accountants and the history are
checkpointed so a restarted ServerApp resumes from the last completed round.

A round in which fewer clients train than ``min-train-nodes``, or more than the
``accept-failures`` fraction fail, stops the run with :class:`RoundFailedError`
quoting the first client's error (Flower then marks the run failed); the round's
failures are in the history either way. A round that cannot start because fewer
SuperNodes are connected than the inner strategy samples waits at most
``node-wait-timeout`` seconds for them (Flower's own sampling would wait forever),
then stops the run the same way, saying how to start it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from logging import DEBUG, INFO, WARNING

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from splitfed.errors import ConfigError, RoundFailedError
from splitfed.run.messages import CLIENT_CLIPPING, CLIENT_KEY, PRIVACY_RECORD, PRIVACY_STATES, with_prefix
from splitfed.run.server import ServerRunner
from .cuts import complete_replies, load_trunk
from .factory import client_clipping, describe_strategy
from .metrics import user_facing
from .replies import RoundReplies, merge_records
from .state import load_strategy_state, strategy_state
from .trunk_copies import TrunkCopies, build_trunk_strategy

#: Name of the ConfigRecord SplitFed adds its ``splitfed.``-prefixed values to when a strategy sends none
#: (Flower's strategies send one, ``"config"``, and SplitFed adds to that).
SPLITFED_RECORD = "config"
#: Prefix of the trunk strategy's state (V1's trunk copies) among the checkpoint's strategy tensors.
TRUNK_PREFIX = "trunk-"


def _class_name(obj: object) -> str:
    """``module.QualName`` of ``obj``'s class (what the history records)."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


class SplitFed(Strategy):
    """A Flower strategy that runs SplitFed rounds around an inner strategy.

    Args:
        strategy: aggregates the client parts (any Flower ``Strategy``).
        runner: the server side of the run (trunk server, tokens, checkpoints).
        trunk_strategy: with ``trunk-mode = "per-client"``, merges the round's trunk copies (default: the one
            ``trunk-strategy`` names, else the one ``strategy`` names in the run config: a custom ``strategy``
            object is not reused for the trunk, pass it here too for that).

    Raises:
        ConfigError: ``trunk_strategy`` is given but the trunk does not run per-client copies.
    """

    def __init__(self, strategy: Strategy, runner: ServerRunner, trunk_strategy: Strategy | None = None) -> None:
        self.strategy = strategy
        self.runner = runner
        self.trunk_copies: TrunkCopies | None = None
        if trunk_strategy is not None and runner.cfg.trunk_mode != "per-client":
            raise ConfigError(f"trunk_strategy={type(trunk_strategy).__name__} merges per-client trunk copies, but "
                              f"trunk-mode is {runner.cfg.trunk_mode!r}: set trunk-mode = 'per-client', or pass no "
                              "trunk_strategy")
        if runner.cfg.trunk_mode == "per-client":
            self.trunk_copies = TrunkCopies(trunk_strategy or build_trunk_strategy(runner.cfg))
        runner.strategy_classes = {"strategy": _class_name(strategy)}
        if self.trunk_copies is not None:
            runner.strategy_classes["trunk-strategy"] = _class_name(self.trunk_copies.strategy)
        runner.strategy_settings = {"strategy": describe_strategy(strategy)}  # classes and arguments used
        if self.trunk_copies is not None:
            runner.strategy_settings["trunk-strategy"] = describe_strategy(self.trunk_copies.strategy)
        self._offset = runner.round_offset
        self._last_train: MetricRecord | None = None
        self._last_eval: MetricRecord | None = None
        self._sent = {"train": 0, "evaluate": 0}
        self._outcomes: dict[str, RoundReplies | None] = {"train": None, "evaluate": None}
        self._node_keys: dict[int, str] = {}  # node id -> client key, learnt from train replies
        self._trunk_counters: dict[str, float] = {}
        if runner.strategy_state:
            load_strategy_state(strategy, runner.strategy_state)
            if self.trunk_copies is not None:
                load_strategy_state(self.trunk_copies.strategy, runner.strategy_state, prefix=TRUNK_PREFIX)

    # -- helpers ---------------------------------------------------------------------------------
    def _round(self, server_round: int) -> int:
        """The run's round number (rounds continue after a resume)."""
        return server_round + self._offset

    def _privacy_for(self, node: int) -> str | None:
        """JSON of the accountants this node may need: its own once known, else every client's."""
        states = self.runner.privacy_states
        if not states:
            return None
        key = self._node_keys.get(node)
        return json.dumps({key: states[key]} if key in states else states)

    def _with_trunk(self, messages: Iterable[Message], server_round: int) -> list[Message]:
        """The inner strategy's messages with SplitFed's per-node values added to their one ConfigRecord.

        The values go under ``splitfed.``-prefixed keys (:mod:`splitfed.run.messages`) into the ConfigRecord the
        strategy sent (``"config"``; one is made when it sent none), so the message holds one ArrayRecord and
        one ConfigRecord, as Flower's own do and as Flower's mods (``fixedclipping_mod``...) require.
        """
        out = []
        clipping = client_clipping(self.strategy)
        for msg in messages:
            node = msg.metadata.dst_node_id
            content = RecordDict(dict(msg.content.items()))
            values = dict(self.runner.trunk_config(node, server_round))
            if msg.metadata.message_type == "train":
                privacy = self._privacy_for(node)
                if privacy is not None:
                    values[PRIVACY_STATES] = privacy
                if clipping:
                    values[CLIENT_CLIPPING] = clipping
            names = list(content.config_records)
            name = names[0] if names else SPLITFED_RECORD
            content[name] = ConfigRecord({**(dict(content[name]) if names else {}), **with_prefix(values)})
            out.append(Message(content=content, dst_node_id=node, message_type=msg.metadata.message_type,
                               group_id=msg.metadata.group_id or None))
        return out

    def _needed_nodes(self, kind: str) -> int:
        """How many connected nodes the inner strategy waits for before it samples ``kind`` (train/evaluate):
        its ``min_available_nodes`` and ``min_<kind>_nodes``, 0 when it samples no one (``fraction_<kind>`` 0)."""
        inner = self.strategy
        if getattr(inner, f"fraction_{kind}", 1.0) == 0.0:
            return 0
        fallback = self.runner.cfg.min_train_nodes
        return max(int(getattr(inner, "min_available_nodes", fallback)), int(getattr(inner, f"min_{kind}_nodes",
                                                                                      fallback)))

    def _await_nodes(self, grid: Grid, run_round: int, kind: str) -> None:
        """Wait until the inner strategy can sample (at most ``node-wait-timeout`` seconds, logging every 10 s).

        Raises:
            RoundFailedError: fewer nodes are connected than it needs when the time is up; the message says how
                many, and how to start the run (more SuperNodes, or a lower ``min-train-nodes``).
        """
        needed, cfg = self._needed_nodes(kind), self.runner.cfg
        deadline = time.monotonic() + cfg.node_wait_timeout
        next_log = 0.0
        while (connected := len(list(grid.get_node_ids()))) < needed:
            now = time.monotonic()
            if now >= deadline:
                error = (f"round {run_round}: {connected} SuperNode(s) connected after {cfg.node_wait_timeout:g} s "
                         f"of waiting, and {kind} needs {needed} (min-train-nodes = {cfg.min_train_nodes}): start "
                         f"at least {needed} SuperNodes (a simulation: --federation-config \"num-supernodes="
                         f"{needed}\"), or let fewer train with --run-config \"min-train-nodes={max(connected, 1)}\" "
                         f"(node-wait-timeout sets how long a round waits for SuperNodes)")
                self.runner.fail_round(run_round, {}, error)
                raise RoundFailedError(error)
            if now >= next_log:
                log(WARNING, "round %s: %s of the %s SuperNodes %s needs are connected (min-train-nodes = %s); "
                    "waiting at most %.0f s more", run_round, connected, needed, kind, cfg.min_train_nodes,
                    deadline - now)
                next_log = now + 10.0
            time.sleep(0.2)

    # -- Strategy hooks -----------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                        ) -> Iterable[Message]:
        """The inner strategy's train messages, each with the trunk's address and a fresh token.

        Raises:
            RoundFailedError: too few SuperNodes connected within ``node-wait-timeout``.
        """
        run_round = self._round(server_round)
        self._await_nodes(grid, run_round, "train")
        messages = self._with_trunk(self.strategy.configure_train(run_round, arrays, config, grid), run_round)
        self.runner.begin_round(run_round, [m.metadata.dst_node_id for m in messages])
        if self.trunk_copies is not None:
            self.trunk_copies.configure(run_round, self.runner.runtime, grid)
        self._sent["train"] = len(messages)
        self._outcomes = {"train": None, "evaluate": None}
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The inner strategy aggregates the client parts; failures join the metrics (trunk counters: history).

        Raises:
            RoundFailedError: fewer successful replies than ``min-train-nodes``, or more failures than
                ``accept-failures`` allows; the message quotes the first client's error.
        """
        run_round = self._round(server_round)
        replies = list(replies)
        outcome = RoundReplies.sort("train", self._sent["train"], replies)
        self._outcomes["train"] = outcome
        cfg = self.runner.cfg
        needed = outcome.needed(cfg.min_train_nodes, cfg.accept_failures)
        if len(outcome.ok) < needed:
            error = (f"round {run_round}: {len(outcome.ok)} of {outcome.sent} clients trained, {needed} needed "
                     f"(min-train-nodes = {cfg.min_train_nodes}, accept-failures = {cfg.accept_failures}); "
                     f"first failure: {outcome.errors[0] if outcome.errors else 'none'}")
            self.runner.fail_round(run_round, merge_records(outcome), error)
            raise RoundFailedError(error)
        if outcome.errors:
            log(WARNING, "round %s: %s of %s clients failed; first: %s", run_round, outcome.failed, outcome.sent,
                outcome.errors[0])
        for reply in outcome.ok:
            self._keep_privacy_state(reply)
        if cfg.client_cuts:  # whole-model replies: each client's parts plus the trunk's copy of its blocks
            complete_replies(outcome.ok, self.runner.runtime)
        arrays, metrics = self.strategy.aggregate_train(run_round, outcome.ok)
        if cfg.client_cuts:  # the trunk starts the next round from the merged version of its blocks
            load_trunk(arrays, self.runner.runtime)
        copies = {} if self.trunk_copies is None else self.trunk_copies.merge(run_round, self.runner.runtime)
        # What a user reads each round stays in the record Flower logs; the trunk's counters go to the history.
        self._trunk_counters = {k: float(v) for k, v in copies.items()}
        metrics = MetricRecord({**(dict(metrics) if metrics is not None else {}), "train-failures": outcome.failed})
        self._last_train = metrics  # all of it goes to the history
        log(DEBUG, "round %s: train metrics %s", run_round, dict(metrics))
        return arrays, user_facing(metrics)

    def _keep_privacy_state(self, reply: Message) -> None:
        if PRIVACY_RECORD not in reply.content.config_records:
            return
        record = dict(reply.content.config_records[PRIVACY_RECORD])
        key = str(record.pop(CLIENT_KEY))
        self._node_keys[reply.metadata.src_node_id] = key
        self.runner.record_privacy_state(key, record)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                           ) -> Iterable[Message]:
        """The inner strategy's evaluate messages, each with the trunk's address and a token.

        Raises:
            RoundFailedError: too few SuperNodes connected within ``node-wait-timeout``.
        """
        run_round = self._round(server_round)
        self._await_nodes(grid, run_round, "evaluate")
        messages = self._with_trunk(self.strategy.configure_evaluate(run_round, arrays, config, grid), run_round)
        self._sent["evaluate"] = len(messages)
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The inner strategy aggregates the evaluation metrics; failed evaluations are counted.

        Raises:
            RoundFailedError: every client's evaluation failed.
        """
        run_round = self._round(server_round)
        outcome = RoundReplies.sort("evaluate", self._sent["evaluate"], list(replies))
        self._outcomes["evaluate"] = outcome
        if outcome.sent and not outcome.ok:
            error = (f"round {run_round}: all {outcome.sent} clients failed to evaluate; first failure: "
                     f"{outcome.errors[0]}")
            self.runner.fail_round(run_round, merge_records(self._outcomes["train"], outcome), error)
            raise RoundFailedError(error)
        metrics = self.strategy.aggregate_evaluate(run_round, outcome.ok)
        if metrics is not None:
            metrics = MetricRecord({**dict(metrics), "eval-failures": outcome.failed})
        self._last_eval = metrics
        return user_facing(metrics)

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
                state = strategy_state(self.strategy)
                if self.trunk_copies is not None:
                    state.update(strategy_state(self.trunk_copies.strategy, prefix=TRUNK_PREFIX))
                self.runner.end_round(self._round(server_round), arrays.to_torch_state_dict(),
                                      dict(self._last_train or {}), dict(self._last_eval or {}),
                                      failures=merge_records(self._outcomes["train"], self._outcomes["evaluate"]),
                                      strategy_state=state, trunk=self._trunk_counters,
                                      central=dict(central) if central is not None else None)
                self._trunk_counters = {}
            return central

        return super().start(grid, initial_arrays, num_rounds=num_rounds, timeout=timeout, train_config=train_config,
                             evaluate_config=evaluate_config, evaluate_fn=end_of_round)
