"""What SplitFed hands on as the next global client parts is exactly the inner strategy's rule applied to the
clients' replies: a weighted mean (FedAvg, FedProx), the element-wise median (FedMedian), server-side Adam
(FedAdam, moments carried across rounds). Each rule is written out here independently of Flower. FedProx's
proximal term is checked on the client: training with ``proximal-mu`` equals training on the loss plus
``mu/2 * ||w - w_global||^2``."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch
from flower_harness import default_run_config, run_apps

from splitfed.config import RunConfig


def _spy(strategy: Any, seen: dict[str, list[Any]]) -> Any:
    """Record the global arrays each round starts from, the train configs, the replies and the aggregate."""
    configure, aggregate = strategy.configure_train, strategy.aggregate_train

    def configure_train(server_round, arrays, config, grid):  # type: ignore[no-untyped-def]
        messages = list(configure(server_round, arrays, config, grid))
        seen["start"].append(arrays.to_torch_state_dict())
        seen["configs"].append([dict(m.content["config"]) for m in messages])
        return messages

    def aggregate_train(server_round, replies):  # type: ignore[no-untyped-def]
        replies = list(replies)
        seen["replies"].append([(r.content["arrays"].to_torch_state_dict(), float(r.content["metrics"]["num-examples"]))
                                for r in replies if not r.has_error()])
        arrays, metrics = aggregate(server_round, replies)
        seen["result"].append(arrays.to_torch_state_dict())
        return arrays, metrics

    strategy.configure_train, strategy.aggregate_train = configure_train, aggregate_train
    return strategy


def _run(tmp_path, monkeypatch, strategy: str, rounds: int, **settings: Any) -> tuple[dict[str, list[Any]], Any, Any]:
    import apps.server_app as server_app
    from strategies import build_strategy

    seen: dict[str, list[Any]] = {"start": [], "configs": [], "replies": [], "result": []}
    built: list[Any] = []

    def spied(cfg: RunConfig) -> Any:
        built.append(_spy(build_strategy(cfg), seen))
        return built[-1]

    monkeypatch.setattr(server_app, "build_strategy", spied)
    _, out = run_apps(tmp_path, num_nodes=3, concurrency=3, num_server_rounds=rounds,
                      **{"local_steps": 2, **settings}, strategy=strategy)
    return seen, built[0], out


def _weighted_mean(replies: list[tuple[dict[str, torch.Tensor], float]]) -> dict[str, torch.Tensor]:
    total = sum(w for _, w in replies)
    return {k: sum(s[k].double() * w for s, w in replies) / total for k in replies[0][0]}


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k].double(), want[k].double(), rtol=1e-6, atol=1e-7, msg=k)


def _final_client_state(out) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "checkpoint" / "clients.safetensors"))


@pytest.mark.parametrize("strategy", ["fedavg", "fedprox"])
def test_fedavg_and_fedprox_hand_on_the_weighted_mean_of_the_replies(tmp_path, monkeypatch, strategy: str) -> None:
    # Dirichlet shards of unequal size, one epoch each: every client reports another number of examples, so the
    # weighted mean cannot be told for the plain mean by accident.
    seen, inner, out = _run(tmp_path, monkeypatch, strategy, rounds=1, partitioner="dirichlet", local_steps=0,
                            local_epochs=1, batch_size=256, eval_batches=1)
    (replies,) = seen["replies"]
    assert len(replies) == 3 and len({w for _, w in replies}) == 3
    plain = {k: sum(s[k].double() for s, _ in replies) / 3 for k in replies[0][0]}
    assert any(not torch.allclose(plain[k], _weighted_mean(replies)[k], rtol=1e-5, atol=1e-6) for k in plain)
    _assert_equal(seen["result"][0], _weighted_mean(replies))
    _assert_equal(_final_client_state(out), seen["result"][0])  # what the run keeps is that aggregate
    mu = [c.get("proximal-mu") for c in seen["configs"][0]]
    assert mu == ([0.01] * 3 if strategy == "fedprox" else [None] * 3)  # FedProx sends its mu to every client


def test_fedmedian_hands_on_the_element_wise_median(tmp_path, monkeypatch) -> None:
    seen, _, out = _run(tmp_path, monkeypatch, "fedmedian", rounds=1)
    (replies,) = seen["replies"]
    median = {k: torch.stack([s[k] for s, _ in replies]).median(dim=0).values for k in replies[0][0]}  # 3: exact
    _assert_equal(seen["result"][0], median)
    _assert_equal(_final_client_state(out), median)


def test_fedadam_applies_server_adam_with_moments_across_rounds(tmp_path, monkeypatch) -> None:
    seen, inner, out = _run(tmp_path, monkeypatch, "fedadam", rounds=2)
    eta, b1, b2, tau = inner.eta, inner.beta_1, inner.beta_2, inner.tau
    assert eta == RunConfig.from_mapping(default_run_config()).server_lr
    m: dict[str, torch.Tensor] = {}
    v: dict[str, torch.Tensor] = {}
    for server_round, (start, replies) in enumerate(zip(seen["start"], seen["replies"]), start=1):
        mean = _weighted_mean(replies)
        x = {k: start[k].double() for k in mean}
        delta = {k: mean[k] - x[k] for k in mean}
        m = {k: b1 * m.get(k, torch.zeros_like(d)) + (1 - b1) * d for k, d in delta.items()}
        v = {k: b2 * v.get(k, torch.zeros_like(d)) + (1 - b2) * d * d for k, d in delta.items()}
        eta_norm = eta * (1 - b2 ** (server_round + 1)) ** 0.5 / (1 - b1 ** (server_round + 1))
        want = {k: x[k] + eta_norm * m[k] / (v[k].sqrt() + tau) for k in x}
        torch.testing.assert_close({k: t.double() for k, t in seen["result"][server_round - 1].items()}, want,
                                   rtol=1e-5, atol=1e-6)
    # Round 2 started from round 1's aggregate, and the run ends on round 2's.
    _assert_equal(seen["start"][1], seen["result"][0])
    _assert_equal(_final_client_state(out), seen["result"][1])


def test_the_proximal_term_is_the_gradient_of_mu_half_squared_distance() -> None:
    """client_train with proximal-mu (on a local trunk) equals SGD on loss + mu/2 ||w - w_global||^2."""
    from splitfed.client.round import client_train
    from splitfed.data import batches
    from splitfed.models.parts import build_parts, client_state, initial_client_state, load_client_state
    from splitfed.split import SplitModel
    from splitfed.workload import load_splits

    cfg = RunConfig.from_mapping(default_run_config(local_steps=4, lr=0.05, momentum=0.9))
    split = build_parts(cfg)
    state = initial_client_state(cfg, split)
    splits = load_splits(cfg, 0, 4)
    mu = 0.5
    results = {m: client_train(cfg, state, copy.deepcopy(split.trunk), splits, server_round=1, partition_id=0,
                               proximal_mu=m).state for m in (0.0, mu)}
    # The same steps written out: the proximal term as part of the loss.
    ref = SplitModel(copy.deepcopy(split.bottom), copy.deepcopy(split.trunk), copy.deepcopy(split.top),
                     task=split.task)
    load_client_state(ref, state)
    params = [p for p in ref.client_modules().parameters() if p.requires_grad]
    anchors = [p.detach().clone() for p in params]
    optimizer = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)
    data = batches(splits.train, cfg.batch_size, splits.kind, seed=cfg.seed * 100_003 + 1 * 1009 + 0)
    ref.train()
    for _ in range(cfg.local_steps):
        batch = next(data)
        loss = ref(batch.inputs, labels=batch.labels).loss
        loss = loss + mu / 2 * sum(((p - a) ** 2).sum() for p, a in zip(params, anchors))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    want = client_state(ref)
    for k in want:
        torch.testing.assert_close(results[mu][k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    assert any(not torch.allclose(results[0.0][k], want[k]) for k in want)  # mu made a difference
    assert json.dumps(sorted(want)) == json.dumps(sorted(results[mu]))
