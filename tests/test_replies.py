"""A round's replies sorted into successes and failures, the clients a round needs, Flower's wrapping of a
client's error taken off, and the inner strategy's state saved and restored."""

from __future__ import annotations

from unittest.mock import Mock

import numpy as np
import pytest
from flwr.app import Error, Message
from flwr.serverapp.strategy import FedAdagrad, FedAvgM, FedYogi

from strategies.replies import RoundReplies, failure_reason, merge_records
from strategies.state import load_strategy_state, strategy_state


def _reply(node: int, reason: str | None = None) -> Message:
    msg = Mock(spec=Message)
    msg.metadata.src_node_id = node
    msg.has_error.return_value = reason is not None
    msg.error = Error(code=0, reason=reason or "")
    return msg


@pytest.mark.parametrize("reason, text", [
    # simulation (Ray): the ClientApp's exception inside ClientAppException inside the type:<'...'> format
    ("<class 'flwr.clientapp.client_app.ClientAppException'>:<'\nException ClientAppException occurred. Message: "
     "ClientFailedError: ConfigError: the dataset is empty'>", "ConfigError: the dataset is empty"),
    # deployment (SuperNode): the type:<'...'> format around the message
    ("<class 'splitfed.errors.ClientFailedError'>:<'RuntimeError: disk full'>", "RuntimeError: disk full"),
    # anything else is kept as it is
    ("ClientFailedError: ValueError: bad", "ValueError: bad"), ("timed out", "timed out"),
])
def test_failure_reason_is_the_clients_own_text(reason: str, text: str) -> None:
    assert failure_reason(_reply(5, reason)) == text


def test_replies_sorted_and_missing_ones_counted_as_failures() -> None:
    outcome = RoundReplies.sort("train", 4, [_reply(1), _reply(2, "ClientFailedError: OSError: gone"), _reply(3)])
    assert len(outcome.ok) == 2 and outcome.failed == 2
    assert outcome.errors == ["node 2: OSError: gone", "no reply from 1 node(s) before the round's timeout"]
    evaluate = RoundReplies.sort("evaluate", 2, [_reply(1), _reply(2)])
    assert merge_records(outcome, evaluate) == {"train": 2, "train-sent": 4, "train-first-error": "node 2: OSError: "
                                                "gone", "evaluate": 0, "evaluate-sent": 2,
                                                "first-error": "node 2: OSError: gone"}


@pytest.mark.parametrize("sent, min_nodes, accept, needed", [
    (3, 2, 0.5, 2), (4, 2, 0.5, 2), (10, 2, 0.5, 5), (4, 2, 0.0, 4), (4, 2, 1.0, 2), (3, 3, 0.9, 3), (7, 1, 0.3, 5),
])
def test_successes_a_round_needs(sent: int, min_nodes: int, accept: float, needed: int) -> None:
    assert RoundReplies("train", sent).needed(min_nodes, accept) == needed


@pytest.mark.parametrize("cls", [FedYogi, FedAdagrad, FedAvgM])
def test_strategy_state_round_trips(cls: type) -> None:
    rng = np.random.default_rng(0)
    strategy = cls()
    if cls is FedAvgM:
        strategy.momentum_vector = [rng.standard_normal((3, 2)).astype(np.float32), rng.standard_normal(4)]
    else:
        strategy.m_t = {"a": rng.standard_normal((3, 2)).astype(np.float32)}
        strategy.v_t = {"a": rng.random((3, 2)).astype(np.float32)}
    saved = strategy_state(strategy)
    fresh = cls()
    load_strategy_state(fresh, saved)
    for attr in ("m_t", "v_t", "momentum_vector"):
        before, after = getattr(strategy, attr, None), getattr(fresh, attr, None)
        if isinstance(before, dict):
            assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)
        elif isinstance(before, list):
            assert len(before) == len(after) and all(np.array_equal(b, a) and b.dtype == a.dtype
                                                     for b, a in zip(before, after))
        else:
            assert after is None
