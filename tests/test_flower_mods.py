"""Flower's mods and strategies on the SplitFed apps, as Flower documents them: messages hold one ArrayRecord and
one ConfigRecord (SplitFed's values ride in it as ``splitfed.*`` keys), client-side DP wrappers get clipped
updates (measured), mods run in train and evaluate rounds, and the clients use what the strategy sends (the
step they take scales with the lr the strategy sends)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from flower_harness import ROOT, run_apps

from splitfed.config import RunConfig


def _norm(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum(((after[k].double() - before[k].double()) ** 2).sum() for k in before)))


def _spied_build(monkeypatch: pytest.MonkeyPatch, seen: dict[str, list[Any]], wrap: Any = None) -> None:
    """Make the ServerApp's strategy record the global arrays it sends and the client parts it aggregates."""
    import apps.server_app as server_app
    from strategies import build_strategy

    def spied(cfg: RunConfig) -> Any:
        strategy = build_strategy(cfg)
        inner = getattr(strategy, "strategy", strategy)  # inside a DP wrapper: what it aggregates (clipped)
        configure, aggregate = inner.configure_train, inner.aggregate_train

        def configure_train(server_round, arrays, config, grid):  # type: ignore[no-untyped-def]
            seen["start"].append(arrays.to_torch_state_dict())
            return configure(server_round, arrays, wrap(server_round, config) if wrap else config, grid)

        def aggregate_train(server_round, replies):  # type: ignore[no-untyped-def]
            replies = list(replies)
            seen["replies"].append([r.content["arrays"].to_torch_state_dict() for r in replies if not r.has_error()])
            seen["metrics"].append([dict(r.content["metrics"]) for r in replies if not r.has_error()])
            return aggregate(server_round, replies)

        inner.configure_train, inner.aggregate_train = configure_train, aggregate_train
        return strategy

    monkeypatch.setattr(server_app, "build_strategy", spied)


def _seen() -> dict[str, list[Any]]:
    return {"start": [], "replies": [], "metrics": []}


def _documented_run_config() -> dict[str, Any]:
    """The ``--run-config`` of docs/privacy.md's client-side clipping command, parsed as Flower parses it."""
    import re
    import shlex

    from flwr.common.config import parse_config_args

    text = (ROOT / "docs" / "privacy.md").read_text()
    line = next(x for x in text.splitlines() if x.startswith("flwr run") and "client-fixed" in x)
    args = shlex.split(line)
    parsed = parse_config_args([args[args.index("--run-config") + 1]])
    assert re.search(r"clipping-norm=[0-9.]+", str(parsed["dp-args"]))
    return parsed


def test_client_side_clipping_wrapper_clips_on_the_unchanged_client_app(tmp_path, monkeypatch) -> None:
    """docs/privacy.md's command (dp-wrapper = client-fixed): the project's ClientApp (no mod added) clips every
    update to clipping-norm, and the evaluate rounds run (fraction-evaluate 1)."""
    from strategies.factory import DP_WRAPPERS, typed_args

    settings = _documented_run_config()
    assert settings["fraction-evaluate"] > 0
    clip = typed_args(DP_WRAPPERS["client-fixed"], settings["dp-args"], "dp-args")["clipping_norm"]
    seen = _seen()
    _spied_build(monkeypatch, seen)
    _, out = run_apps(tmp_path, num_nodes=2, num_server_rounds=1, local_steps=3, **settings)
    norms = [_norm(r, seen["start"][0]) for r in seen["replies"][0]]
    assert len(norms) == 2 and all(n == pytest.approx(clip, rel=1e-3) for n in norms)  # 3 steps move far more
    history = json.loads((out / "history.json").read_text())
    evaluated = history["rounds"][0]["evaluate"]
    assert evaluated["num-examples"] > 0 and "eval-accuracy" in evaluated
    described = history["strategies"]["strategy"]
    assert described["class"].endswith("DifferentialPrivacyClientSideFixedClipping")
    assert described["args"]["clipping_norm"] == clip and described["strategy"]["class"].endswith("FedAvg")


def test_a_client_side_clipping_message_without_clipping_norm_fails_loudly() -> None:
    """Marked for client-side clipping but no clipping_norm: the client refuses to train unclipped."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

    from apps.client_app import clipping_mod
    from splitfed.errors import ClientFailedError
    from splitfed.run.messages import CLIENT_CLIPPING, with_prefix

    msg = Message(RecordDict({"arrays": ArrayRecord(), "config": ConfigRecord(with_prefix({CLIENT_CLIPPING: "fixed",
                                                                                          "trunk-address": "x"}))}),
                  dst_node_id=1, message_type="train")
    called = []
    with pytest.raises(ClientFailedError, match="sent no clipping_norm"):
        clipping_mod(msg, Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={}),
                     lambda m, c: called.append(m))
    assert not called


def test_flower_mods_see_one_config_record_in_train_and_evaluate(tmp_path) -> None:
    """Flower's own mods (message_size_mod, arrays_size_mod, fixedclipping_mod as a train mod) and a user's mod
    run on the ClientApp in train and evaluate rounds; each message holds one ArrayRecord and one ConfigRecord."""
    from flwr.clientapp.mod import arrays_size_mod, fixedclipping_mod, message_size_mod

    import apps.client_app as client_app
    import flower_harness

    seen: list[tuple[str, int, int, list[str]]] = []

    def counting_mod(msg, context, call_next):  # type: ignore[no-untyped-def]
        config = next(iter(msg.content.config_records.values()))
        seen.append((msg.metadata.message_type, len(msg.content.config_records), len(msg.content.array_records),
                     sorted(config.keys())))
        return call_next(msg, context)

    app = client_app.make_client_app(mods=[counting_mod, message_size_mod, arrays_size_mod],
                                     train_mods=[fixedclipping_mod])
    original = client_app.app
    client_app.app = app  # what run_apps imports
    try:
        _, out = flower_harness.run_apps(tmp_path, num_nodes=2, num_server_rounds=2, local_steps=2,
                                         fraction_evaluate=1.0, dp_wrapper="client-fixed",
                                         dp_args="noise-multiplier=0 clipping-norm=0.1 num-sampled-clients=2")
    finally:
        client_app.app = original
    kinds = [s[0] for s in seen]
    assert kinds.count("train") == 4 and kinds.count("evaluate") == 4
    assert {(s[1], s[2]) for s in seen} == {(1, 1)}
    train_keys = next(s[3] for s in seen if s[0] == "train")
    assert "clipping_norm" in train_keys and "lr" in train_keys and "splitfed.trunk-address" in train_keys
    rounds = json.loads((out / "history.json").read_text())["rounds"]
    assert [r["evaluate"]["num-examples"] > 0 for r in rounds] == [True, True]


def test_clients_use_the_lr_and_steps_the_strategy_sends(tmp_path, monkeypatch) -> None:
    """A strategy that lowers lr 100x in round 2 (and sends local-steps, a custom key): the clients' step (the
    norm of their update in one SGD step) shrinks with it; their steps follow local-steps."""
    import apps.client_app as client_app

    def lower_lr(server_round: int, config: Any) -> Any:
        from flwr.app import ConfigRecord

        return ConfigRecord({**dict(config), "lr": 0.05 if server_round == 1 else 0.0005, "local-steps": 1,
                             "my-key": f"round-{server_round}"})

    received: list[dict[str, Any]] = []
    real_train = client_app.client_train

    def recording_train(*args: Any, **kwargs: Any) -> Any:
        received.append(dict(kwargs["round_config"]))
        return real_train(*args, **kwargs)

    monkeypatch.setattr(client_app, "client_train", recording_train)
    seen = _seen()
    _spied_build(monkeypatch, seen, wrap=lower_lr)
    run_apps(tmp_path, num_nodes=2, num_server_rounds=2, local_steps=5, lr=0.05, momentum=0.0,
             fraction_evaluate=0.0)
    first = [_norm(r, seen["start"][0]) for r in seen["replies"][0]]
    second = [_norm(r, seen["start"][1]) for r in seen["replies"][1]]
    ratios = [b / a for a, b in zip(sorted(first), sorted(second))]
    assert all(0.001 < r < 0.05 for r in ratios), (first, second)  # 100x lower lr: a step about 100x shorter
    assert [m["train-steps"] for m in seen["metrics"][0]] == [1, 1]  # local-steps = 1 sent, 5 in the run config
    assert sorted(r["my-key"] for r in received) == ["round-1", "round-1", "round-2", "round-2"]
    assert all("trunk-address" not in "".join(r) for r in received)  # SplitFed's own keys are not the user's


def test_evaluate_config_sets_the_clients_evaluation(tmp_path, monkeypatch) -> None:
    """eval-batches sent in the evaluate config: each client evaluates one batch."""
    import apps.server_app as server_app
    from strategies import build_strategy

    def with_eval_config(cfg: RunConfig) -> Any:
        strategy = build_strategy(cfg)
        configure = strategy.configure_evaluate

        def configure_evaluate(server_round, arrays, config, grid):  # type: ignore[no-untyped-def]
            from flwr.app import ConfigRecord

            return configure(server_round, arrays, ConfigRecord({**dict(config), "eval-batches": 1}), grid)

        strategy.configure_evaluate = configure_evaluate
        return strategy

    monkeypatch.setattr(server_app, "build_strategy", with_eval_config)
    _, out = run_apps(tmp_path, num_nodes=2, num_server_rounds=1, local_steps=1, batch_size=16,
                      fraction_evaluate=1.0)
    evaluated = json.loads((out / "history.json").read_text())["rounds"][0]["evaluate"]
    assert evaluated["num-examples"] == 2 * 16


def test_qfedavg_reads_the_train_loss_the_clients_report(tmp_path) -> None:
    _, out = run_apps(tmp_path, num_nodes=2, num_server_rounds=1, local_steps=2, fraction_evaluate=0.0,
                      strategy="qfedavg", strategy_args="q=0.2")
    history = json.loads((out / "history.json").read_text())
    assert history["status"] == "completed"
    assert history["strategies"]["strategy"]["args"]["q"] == 0.2
    assert history["rounds"][0]["train"]["train_loss"] > 0


@pytest.mark.parametrize("wrapper", ["server-fixed", "server-adaptive", "client-fixed", "client-adaptive"])
def test_every_dp_wrapper_runs_a_round_with_evaluation(tmp_path, wrapper: str) -> None:
    clip = "clipping-norm=0.1" if wrapper.endswith("fixed") else "initial-clipping-norm=0.1 clipped-count-stddev=1"
    _, out = run_apps(tmp_path, num_nodes=2, num_server_rounds=2, local_steps=1, fraction_evaluate=1.0,
                      dp_wrapper=wrapper, dp_args=f"noise-multiplier=0.01 num-sampled-clients=2 {clip}")
    history = json.loads((out / "history.json").read_text())
    assert history["status"] == "completed"
    assert all(r["evaluate"]["num-examples"] > 0 for r in history["rounds"])
    if wrapper == "client-adaptive":  # Flower's adaptiveclipping_mod ran: the clients reported their norm bits
        assert "norm_bit" in history["rounds"][0]["train"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fedavg", "fedprox", "fedadam", "fedavgm", "fedadagrad", "fedyogi",
                                      "fedmedian", "fedtrimmedavg", "krum", "multikrum", "bulyan", "qfedavg"])
def test_every_strategy_runs_a_round(tmp_path, strategy: str) -> None:
    _, out = run_apps(tmp_path, num_nodes=3, concurrency=3, num_server_rounds=1, local_steps=1,
                      fraction_evaluate=1.0, min_train_nodes=3, strategy=strategy)
    history = json.loads((out / "history.json").read_text())
    assert history["status"] == "completed" and history["rounds"][0]["evaluate"]["num-examples"] > 0
