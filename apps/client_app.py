"""SplitFed ClientApp: trains its bottom and top parts with the remote trunk on its own data shard.

A handler that fails raises :class:`~splitfed.errors.ClientFailedError` with the original
exception's type and message, so the server's round report quotes it whole.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from splitfed.client import client_evaluate, client_train, connect_trunk
from splitfed.config import RunConfig
from splitfed.errors import ClientFailedError
from splitfed.hetero import client_config
from splitfed.logs import setup_logging
from splitfed.messages import (
    CLIENT_KEY,
    CUT_END,
    CUT_RECORD,
    CUT_START,
    PRIVACY_RECORD,
    PRIVACY_STATES,
    SERVER_ROUND,
    TRUNK_ADDRESS,
    TRUNK_CA,
    TRUNK_TOKEN,
)
from splitfed.workload import load_splits
from strategies import SPLITFED_RECORD

app = ClientApp()
log = logging.getLogger("splitfed")

#: Where a node keeps its privacy accountant between rounds (Flower's per-node context.state).
PRIVACY_STATE = "splitfed-privacy"


def _reported(handler: Callable[[Message, Context], Message]) -> Callable[[Message, Context], Message]:
    """Re-raise a handler's exception as ClientFailedError("<Type>: <message>") (Flower keeps only the text)."""

    @functools.wraps(handler)
    def wrapped(msg: Message, context: Context) -> Message:
        try:
            return handler(msg, context)
        except ClientFailedError:
            raise
        except Exception as exc:
            log.exception("%s failed on node %s", handler.__name__, context.node_id)
            raise ClientFailedError(f"{type(exc).__name__}: {exc}") from exc
    return wrapped


def _spent(state: Any) -> int:
    """Steps an accountant state has counted (the more recent of two states has counted more)."""
    if state is None:
        return -1
    return sum(int(n) for k, v in dict(state).items() if k.endswith("-steps") for n in v)


def _privacy_state(msg: Message, context: Context, client_key: str) -> dict[str, Any] | None:
    """This node's accountants: its own context.state, or the server's copy after a restart (the later one)."""
    local = dict(context.state[PRIVACY_STATE]) if PRIVACY_STATE in context.state else None
    sent = msg.content[SPLITFED_RECORD].get(PRIVACY_STATES)
    server = json.loads(str(sent)).get(client_key) if sent else None
    return server if _spent(server) > _spent(local) else local


def _setup(msg: Message, context: Context) -> tuple[RunConfig, dict, object, object, int]:
    cfg = RunConfig.from_mapping(context.run_config).for_node(context.node_config)  # its own certificate files
    setup_logging(cfg.log_level, json_lines=cfg.log_json, run_id=context.run_id, client=f"node-{context.node_id}")
    trunk_record = msg.content[SPLITFED_RECORD]
    partition_id = int(context.node_config["partition-id"])
    cfg = client_config(cfg, partition_id, context.node_config)  # its own cuts under client-cuts
    splits = load_splits(cfg, partition_id, int(context.node_config["num-partitions"]))
    trunk = connect_trunk(cfg, str(trunk_record[TRUNK_ADDRESS]), trunk_record.get(TRUNK_TOKEN),
                          client_id=f"node-{context.node_id}", ca_pem=trunk_record.get(TRUNK_CA))
    state = msg.content["arrays"].to_torch_state_dict()
    return cfg, state, trunk, splits, partition_id


@app.train()
@_reported
def train(msg: Message, context: Context) -> Message:
    """One round of local split training; replies with the updated client parts, metrics and accountants."""
    cfg, state, trunk, splits, partition_id = _setup(msg, context)
    config = msg.content["config"]
    client_key = str(partition_id)
    previous = _privacy_state(msg, context, client_key)
    try:
        result = client_train(cfg, state, trunk, splits, int(msg.content[SPLITFED_RECORD][SERVER_ROUND]),
                              partition_id, proximal_mu=float(config.get("proximal-mu", 0.0)),
                              privacy_state=previous)
    finally:
        trunk.close()
    content = RecordDict({"arrays": ArrayRecord(torch_state_dict=result.state),
                          "metrics": MetricRecord(result.metrics)})
    if cfg.client_cuts:  # the server completes this client's blocks [a, b) with the trunk's copy
        content[CUT_RECORD] = ConfigRecord({CUT_START: cfg.cuts[0], CUT_END: cfg.cuts[1]})
    if result.privacy_state:  # the DP accountant outlives this process (deployments run one per message)
        context.state[PRIVACY_STATE] = ConfigRecord(result.privacy_state)
        # ...and the server's checkpoint holds a copy, so a resumed run (a new context) keeps counting.
        content[PRIVACY_RECORD] = ConfigRecord({**result.privacy_state, CLIENT_KEY: client_key})
    return Message(content, reply_to=msg)


@app.evaluate()
@_reported
def evaluate(msg: Message, context: Context) -> Message:
    """Forward-only evaluation of the global client parts with the trunk on the held-out split."""
    cfg, state, trunk, splits, _ = _setup(msg, context)
    try:
        metrics = client_evaluate(cfg, state, trunk, splits)
    finally:
        trunk.close()
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
