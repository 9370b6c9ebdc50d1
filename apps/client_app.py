"""SplitFed ClientApp: trains its bottom and top parts with the remote trunk on its own data shard."""

from __future__ import annotations

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from splitfed.config import RunConfig
from splitfed.logs import setup_logging
from splitfed.client import client_evaluate, client_train, connect_trunk
from splitfed.messages import SERVER_ROUND, TRUNK_ADDRESS, TRUNK_TOKEN
from splitfed.workload import load_splits
from strategies import SPLITFED_RECORD

app = ClientApp()

#: Where a node keeps its privacy accountant between rounds (Flower's per-node context.state).
PRIVACY_STATE = "splitfed-privacy"


def _setup(msg: Message, context: Context) -> tuple[RunConfig, dict, object, object, int]:
    cfg = RunConfig.from_mapping(context.run_config)
    setup_logging(cfg.log_level, json_lines=cfg.log_json, run_id=context.run_id, client=f"node-{context.node_id}")
    trunk_record = msg.content[SPLITFED_RECORD]
    partition_id = int(context.node_config["partition-id"])
    splits = load_splits(cfg, partition_id, int(context.node_config["num-partitions"]))
    trunk = connect_trunk(cfg, str(trunk_record[TRUNK_ADDRESS]), trunk_record.get(TRUNK_TOKEN),
                          client_id=f"node-{context.node_id}")
    state = msg.content["arrays"].to_torch_state_dict()
    return cfg, state, trunk, splits, partition_id


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of local split training; replies with the updated client parts and metrics."""
    cfg, state, trunk, splits, partition_id = _setup(msg, context)
    config = msg.content["config"]
    previous = context.state[PRIVACY_STATE] if PRIVACY_STATE in context.state else None
    try:
        result = client_train(cfg, state, trunk, splits, int(msg.content[SPLITFED_RECORD][SERVER_ROUND]),
                              partition_id, proximal_mu=float(config.get("proximal-mu", 0.0)),
                              privacy_state=previous)
    finally:
        trunk.close()
    if result.privacy_state:  # the DP accountant outlives this process (deployments run one per message)
        context.state[PRIVACY_STATE] = ConfigRecord(result.privacy_state)
    return Message(RecordDict({"arrays": ArrayRecord(torch_state_dict=result.state),
                               "metrics": MetricRecord(result.metrics)}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Forward-only evaluation of the global client parts with the trunk on the held-out split."""
    cfg, state, trunk, splits, _ = _setup(msg, context)
    try:
        metrics = client_evaluate(cfg, state, trunk, splits)
    finally:
        trunk.close()
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
