"""Trunk aggregation modes as pure logic, and sync == one large-batch SGD step on the union of batches."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from conftest import batch_for, tiny_model

from splitfed.errors import ConfigError
from splitfed.split import CutState, causal_lm_loss, split_model
from splitfed.trunk.aggregation.modes import (
    AsyncAggregator,
    Contribution,
    Outcome,
    QuorumAggregator,
    SyncAggregator,
    make_aggregator,
    weighted_mean,
)
from splitfed.trunk.compute.runtime import GradientGuard, TrunkRuntime


class Recorder:
    """Stands in for the trunk: records each update."""

    def __init__(self) -> None:
        self.updates: list[list[torch.Tensor]] = []

    def __call__(self, update) -> None:
        self.updates.append([g.clone() for g in update])


def _c(client: str, value: float, version: int = 0, n: int = 1) -> Contribution:
    return Contribution(client, version, [torch.tensor([value])], n)


def _submit_all(agg, contributions, results) -> list[threading.Thread]:
    threads = []
    for c in contributions:
        t = threading.Thread(target=lambda c=c: results.__setitem__(c.client_id, agg.submit(c)))
        t.start()
        threads.append(t)
    return threads


def test_weighted_mean_is_the_union_batch_mean() -> None:
    out = weighted_mean([_c("a", 1.0, n=1), _c("b", 4.0, n=3)])
    assert out is not None and out[0].item() == pytest.approx((1 * 1 + 4 * 3) / 4)


def test_sync_waits_for_every_member_then_steps_once() -> None:
    agg, rec = SyncAggregator(timeout=10), Recorder()
    agg.bind(rec)
    for name in "abc":
        agg.join(name)
    results: dict = {}
    threads = _submit_all(agg, [_c("a", 1.0), _c("b", 2.0)], results)
    time.sleep(0.2)
    assert rec.updates == [] and not results  # still waiting for c
    threads += _submit_all(agg, [_c("c", 6.0)], results)
    for t in threads:
        t.join(5)
    assert len(rec.updates) == 1 and rec.updates[0][0].item() == pytest.approx(3.0)
    assert {r.outcome for r in results.values()} == {Outcome.APPLIED} and agg.version == 1


def test_sync_drops_a_silent_member_after_the_timeout() -> None:
    agg, rec = SyncAggregator(timeout=0.3), Recorder()
    agg.bind(rec)
    agg.join("a")
    agg.join("dead")
    start = time.monotonic()
    result = agg.submit(_c("a", 1.0))
    assert 0.25 <= time.monotonic() - start < 3
    assert result.outcome is Outcome.APPLIED and agg.members == {"a"} and agg.stats["dropped-members"] == 1
    # The next step no longer waits for it.
    start = time.monotonic()
    agg.submit(_c("a", 1.0, version=1))
    assert time.monotonic() - start < 0.2 and agg.version == 2


def test_leave_releases_a_waiting_bucket() -> None:
    agg, rec = SyncAggregator(timeout=10), Recorder()
    agg.bind(rec)
    agg.join("a")
    agg.join("b")
    results: dict = {}
    threads = _submit_all(agg, [_c("a", 1.0)], results)
    time.sleep(0.1)
    agg.leave("b")
    threads[0].join(5)
    assert results["a"].outcome is Outcome.APPLIED and len(rec.updates) == 1


def test_quorum_steps_at_k_and_stale_gradients_join_the_open_bucket() -> None:
    agg, rec = QuorumAggregator(2, timeout=10, max_staleness=1), Recorder()
    agg.bind(rec)
    for name in "abc":
        agg.join(name)
    results: dict = {}
    for t in _submit_all(agg, [_c("a", 1.0), _c("b", 3.0)], results):
        t.join(5)
    assert len(rec.updates) == 1 and rec.updates[0][0].item() == pytest.approx(2.0)
    # c computed on version 0 (trunk is at 1): it joins a's fresh gradient in one step, not a step of its own.
    late = agg.offer(_c("c", 5.0, version=0))
    assert not late.done() and agg.pending == 1
    fresh = agg.submit(_c("a", 1.0, version=1))
    assert late.result(1).outcome is Outcome.APPLIED and late.result(1).staleness == 1
    assert fresh.staleness == 0 and agg.version == 2 and len(rec.updates) == 2
    assert rec.updates[1][0].item() == pytest.approx(3.0)
    too_late = agg.submit(_c("c", 5.0, version=0))  # 2 stale: rejected at once, nothing waits
    assert too_late.outcome is Outcome.REJECTED_STALE and too_late.staleness == 2 and agg.version == 2


def test_quorum_drops_a_dead_member_and_shrinks_to_the_live_ones() -> None:
    agg, rec = QuorumAggregator(3, timeout=0.3), Recorder()
    agg.bind(rec)
    for name in "abc":
        agg.join(name)
    results: dict = {}
    start = time.monotonic()
    for t in _submit_all(agg, [_c("a", 1.0), _c("b", 1.0)], results):
        t.join(5)
    assert 0.25 <= time.monotonic() - start < 2
    assert len(rec.updates) == 1 and agg.members == {"a", "b"} and agg.stats["dropped-members"] == 1
    # The quorum is now min(3, 2 live members): the next steps do not wait for the dead one.
    for version in (1, 2, 3):
        start = time.monotonic()
        for t in _submit_all(agg, [_c("a", 1.0, version), _c("b", 1.0, version)], results):
            t.join(5)
        assert time.monotonic() - start < 0.2 and agg.version == version + 1


def test_async_applies_each_and_rejects_beyond_max_staleness() -> None:
    agg, rec = AsyncAggregator(max_staleness=2), Recorder()
    agg.bind(rec)
    for v in range(3):
        assert agg.submit(_c("a", 1.0, version=v)).outcome is Outcome.APPLIED
    assert agg.submit(_c("b", 1.0, version=1)).outcome is Outcome.APPLIED  # 2 stale
    rejected = agg.submit(_c("b", 1.0, version=0))  # 4 stale
    assert rejected.outcome is Outcome.REJECTED_STALE and rejected.staleness == 4
    assert agg.version == 4 and agg.stats["rejected-stale"] == 1


def test_async_downweight_policy_scales_stale_gradients() -> None:
    agg, rec = AsyncAggregator(max_staleness=1, staleness_policy="downweight"), Recorder()
    agg.bind(rec)
    for v in range(3):
        agg.submit(_c("a", 1.0, version=v))
    result = agg.submit(_c("b", 8.0, version=0))  # 3 stale, 2 past the bound
    assert result.outcome is Outcome.DOWNWEIGHTED and result.weight == pytest.approx(1 / 3)
    assert rec.updates[-1][0].item() == pytest.approx(8.0 / 3)


class StalenessWeightedQuorum(QuorumAggregator):
    """The README's custom strategy: quorum, late gradients weighted 1 / (1 + staleness)."""

    def staleness_weight(self, staleness: int) -> float | None:
        return 1.0 / (1 + staleness) if staleness <= self.max_staleness else None


def test_custom_staleness_weighted_quorum() -> None:
    agg, rec = StalenessWeightedQuorum(1, max_staleness=3), Recorder()
    agg.bind(rec)
    agg.submit(_c("a", 1.0, version=0))
    agg.submit(_c("a", 1.0, version=1))
    result = agg.submit(_c("b", 6.0, version=0))
    assert result.weight == pytest.approx(1 / 3) and rec.updates[-1][0].item() == pytest.approx(2.0)


@pytest.mark.parametrize("kwargs", [dict(mode="nope"), dict(mode="quorum", quorum=0),
                                    dict(mode="async", max_staleness=-1), dict(mode="sync", timeout=0),
                                    dict(mode="async", staleness_policy="maybe")])
def test_bad_settings_name_the_key(kwargs) -> None:
    with pytest.raises(ConfigError):
        make_aggregator(**kwargs)


def _trunk_runtime(mode: str, n: int, lr: float = 0.1, **kw) -> tuple[TrunkRuntime, object, object]:
    model = tiny_model("gpt2").train()
    ref = copy.deepcopy(model)
    split = split_model(model, cuts=(1, 3))
    agg = make_aggregator(mode, quorum=kw.pop("quorum", n), timeout=kw.pop("timeout", 10), **kw)
    rt = TrunkRuntime(split.trunk, torch.optim.SGD(split.trunk.parameters(), lr=lr), aggregator=agg)
    return rt, split, ref


def test_sync_equals_one_large_batch_sgd_step_on_the_union() -> None:
    """N clients, one sync step: trunk weights equal one unsplit SGD step on the concatenated batch."""
    n = 3
    rt, split, ref = _trunk_runtime("sync", n)
    batches = [batch_for("gpt2", batch=2 + i, seed=10 + i) for i in range(n)]  # unequal sizes
    for i in range(n):
        rt.join(f"c{i}")
    # Each client: bottom forward, trunk forward on the server, top + loss, grad back.
    results: dict = {}

    def client(i: int) -> None:
        ids, mask, labels = batches[i]
        state = split.bottom(ids, attention_mask=mask)
        out, _ = rt.forward(f"c{i}", f"a{i}", CutState(state.hidden.detach(), mask, state.position_ids),
                            train=True, num_examples=ids.shape[0])
        out = out.detach().requires_grad_(True)
        causal_lm_loss(split.top(state.with_hidden(out)), labels).backward()
        results[i] = rt.backward(f"c{i}", f"a{i}", out.grad)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert rt.version == 1 and all(r.result.outcome is Outcome.APPLIED for r in results.values())
    # Reference: one SGD step on the union batch with the trunk's gradient of the union-mean loss.
    ids = torch.cat([b[0] for b in batches])
    labels = torch.cat([b[2] for b in batches])
    ref_trunk = split_model(ref, cuts=(1, 3))
    loss = ref_trunk(ids, labels=labels).loss
    trunk_params = list(ref_trunk.trunk.parameters())
    grads = torch.autograd.grad(loss, trunk_params)
    # Per-sequence loss means differ from token-level union means; match the clients' weighting:
    # each client sends the gradient of its own batch-mean loss, weighted by its number of examples.
    per_client = []
    for b in batches:
        l_i = ref_trunk(b[0], labels=b[2]).loss
        per_client.append((b[0].shape[0], torch.autograd.grad(l_i, trunk_params)))
    total = sum(k for k, _ in per_client)
    want = [sum(k * g[j] for k, g in per_client) / total for j in range(len(trunk_params))]
    with torch.no_grad():
        expected = [p - 0.1 * g for p, g in zip(trunk_params, want)]
    for p, e in zip(split.trunk.parameters(), expected):
        assert torch.allclose(p, e, atol=1e-6)
    # With equal-length sequences and no padding, that is exactly the union batch's mean-loss step.
    for g_union, g_weighted in zip(grads, want):
        assert torch.allclose(g_union, g_weighted, atol=1e-6)


def test_async_runtime_rebases_pending_forwards_and_computes_exact_stale_gradients() -> None:
    """A forward that waits while the trunk steps gets the gradient of the weights it saw."""
    rt, split, _ = _trunk_runtime("async", 2, max_staleness=5)
    ids, mask, labels = batch_for("gpt2")
    state = split.bottom(ids, attention_mask=mask)
    cut = CutState(state.hidden.detach(), mask, state.position_ids)
    frozen = copy.deepcopy(split.trunk)
    out_a, v_a = rt.forward("a", "fa", cut, train=True)
    out_b, _ = rt.forward("b", "fb", cut, train=True)
    grad = torch.randn_like(out_a)
    rt.backward("b", "fb", grad)  # trunk steps: version 1, "fa" is rebased
    assert rt.version == 1 and rt.stats["rebased"] == 1
    w1_copy = copy.deepcopy(split.trunk)
    result = rt.backward("a", "fa", grad)
    assert result.result.outcome is Outcome.APPLIED and result.result.staleness == 1
    leaf = cut.hidden.clone().requires_grad_(True)
    w0 = list(frozen.parameters())
    want = torch.autograd.grad(frozen(cut.with_hidden(leaf)).hidden, [leaf] + w0, grad)
    assert torch.allclose(result.grad_in, want[0], atol=1e-6) and rt.stats["recomputed"] == 1
    # The trunk's own gradient was kept and applied: W2 = W1 - lr * grad(W0), not thrown away.
    assert rt.version == 2
    for p, w1, g in zip(split.trunk.parameters(), w1_copy.parameters(), want[1:]):
        assert torch.allclose(p, w1 - 0.1 * g, atol=1e-6)
    assert not all(torch.allclose(p, w1) for p, w1 in zip(split.trunk.parameters(), w1_copy.parameters()))


def test_gradient_guard_refuses_exploding_gradients_without_stepping() -> None:
    rt, split, _ = _trunk_runtime("async", 1, max_staleness=1)
    rt.guard = GradientGuard(max_norm=1e-6)
    before = copy.deepcopy(split.trunk.state_dict())
    ids, mask, _ = batch_for("gpt2")
    state = split.bottom(ids, attention_mask=mask)
    out, _ = rt.forward("a", "x", CutState(state.hidden.detach(), mask, state.position_ids), train=True)
    result = rt.backward("a", "x", torch.ones_like(out) * 1e3)
    assert result.result.outcome is Outcome.REJECTED_GUARD and rt.version == 0
    assert all(torch.equal(before[k], v) for k, v in split.trunk.state_dict().items())
