"""SplitFed ClientApp: trains its bottom and top parts with the remote trunk on its own data shard.

Messages look as Flower's own do (one ArrayRecord, one ConfigRecord; SplitFed's per-node values ride in that
ConfigRecord under ``splitfed.`` keys), so Flower's mods work on this app: :func:`make_client_app` builds it
with mods of your own (``mods`` for every message, ``train_mods``/``evaluate_mods`` for one kind). What the
strategy sends (``lr``, ``local-steps``, ``proximal-mu``, your own keys) is what the clients use. When the
server's strategy is one of Flower's client-side clipping DP wrappers, the train handler clips through Flower's
``fixedclipping_mod``/``adaptiveclipping_mod`` by itself: a client never trains unclipped for such a server.

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
from flwr.clientapp.mod import adaptiveclipping_mod, fixedclipping_mod
from flwr.clientapp.typing import ClientAppCallable, Mod

from splitfed.client.round import client_evaluate, client_train, connect_trunk
from splitfed.config import RunConfig
from splitfed.errors import ClientFailedError
from splitfed.models.hetero import client_config
from splitfed.logs import setup_logging
from splitfed.run.messages import (
    CLIENT_CLIPPING,
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
    splitfed_values,
    strategy_values,
)
from splitfed.workload import load_splits
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
    sent = splitfed_values(_config(msg)).get(PRIVACY_STATES)
    server = json.loads(str(sent)).get(client_key) if sent else None
    return server if _spent(server) > _spent(local) else local


def _config(msg: Message) -> ConfigRecord:
    """The message's ConfigRecord: the strategy's config, with SplitFed's ``splitfed.`` keys in it."""
    records = list(msg.content.config_records.values())
    with_splitfed = [r for r in records if splitfed_values(r)]
    if not with_splitfed:
        raise ClientFailedError(f"the {msg.metadata.message_type} message carries no splitfed.* keys in its "
                                "ConfigRecord: run it with the SplitFed ServerApp (apps/server_app.py) or wrap "
                                "your strategy in strategies.SplitFed")
    return with_splitfed[0]


def _arrays(msg: Message) -> ArrayRecord:
    """The message's one ArrayRecord (the global client parts), whatever the strategy named it."""
    return next(iter(msg.content.array_records.values()))


def _setup(msg: Message, context: Context) -> tuple[RunConfig, dict, object, object, int]:
    cfg = RunConfig.from_mapping(context.run_config).for_node(context.node_config)  # its own certificate files
    setup_logging(cfg.log_level, json_lines=cfg.log_json, run_id=context.run_id, client=f"node-{context.node_id}")
    ours = splitfed_values(_config(msg))
    partition_id = int(context.node_config["partition-id"])
    cfg = client_config(cfg, partition_id, context.node_config)  # its own cuts under client-cuts
    splits = load_splits(cfg, partition_id, int(context.node_config["num-partitions"]))
    trunk = connect_trunk(cfg, str(ours[TRUNK_ADDRESS]), ours.get(TRUNK_TOKEN),
                          client_id=f"node-{context.node_id}", ca_pem=ours.get(TRUNK_CA))
    state = _arrays(msg).to_torch_state_dict()
    return cfg, state, trunk, splits, partition_id


def clipping_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Clip the update as the server's strategy expects: Flower's ``fixedclipping_mod`` (or
    ``adaptiveclipping_mod`` for the adaptive wrapper) when the train config carries ``clipping_norm``.

    A train message that SplitFed marks for client-side clipping but that holds no ``clipping_norm`` fails the
    round instead of training unclipped.
    """
    config = _config(msg)
    kind = str(splitfed_values(config).get(CLIENT_CLIPPING, ""))
    if "clipping_norm" not in config:
        if kind:
            raise ClientFailedError(f"the server's strategy clips on the clients ({kind}) but sent no clipping_norm")
        return call_next(msg, context)
    mod = adaptiveclipping_mod if kind == "adaptive" else fixedclipping_mod
    return mod(msg, context, call_next)


@_reported
def train(msg: Message, context: Context) -> Message:
    """One round of local split training; replies with the updated client parts, metrics and accountants.

    What the strategy sent (``lr``, ``local-steps``, ``local-epochs``, ``proximal-mu``, your keys) is passed to
    :func:`~splitfed.client.round.client_train` as ``round_config``."""
    cfg, state, trunk, splits, partition_id = _setup(msg, context)
    config = _config(msg)
    client_key = str(partition_id)
    previous = _privacy_state(msg, context, client_key)
    try:
        result = client_train(cfg, state, trunk, splits, int(splitfed_values(config)[SERVER_ROUND]),
                              partition_id, privacy_state=previous, round_config=strategy_values(config))
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


@_reported
def evaluate(msg: Message, context: Context) -> Message:
    """Forward-only evaluation of the global client parts with the trunk on the held-out split (the evaluate
    config's ``batch-size``/``eval-batches`` apply)."""
    cfg, state, trunk, splits, _ = _setup(msg, context)
    try:
        metrics = client_evaluate(cfg, state, trunk, splits, round_config=strategy_values(_config(msg)))
    finally:
        trunk.close()
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


def make_client_app(mods: list[Mod] | None = None, *, train_mods: list[Mod] | None = None,
                    evaluate_mods: list[Mod] | None = None) -> ClientApp:
    """The SplitFed ClientApp with Flower mods of your own: ``mods`` wrap every message (as
    ``ClientApp(mods=...)``), ``train_mods``/``evaluate_mods`` one kind (as ``@app.train(mods=...)``).
    :func:`clipping_mod` always runs first among the train mods (outside yours): it clips last."""
    client_app = ClientApp(mods=list(mods or []))
    client_app.train(mods=[clipping_mod, *(train_mods or [])])(train)
    client_app.evaluate(mods=list(evaluate_mods or []))(evaluate)
    return client_app


app = make_client_app()
