"""The pipelined split step (``micro_batches = k``) trains exactly like the unpipelined one, over the real channel."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ARCHS, batch_for, tiny_cnn, tiny_model

from splitfed.channel.client.remote import RemoteTrunk
from splitfed.optim import make_optimizer
from splitfed.split import SplitModel, causal_lm_loss, classification_loss, split_model
from splitfed.split.microbatch import resolve_micro_batches, split_batch

STEPS = 5
PARTS = 4
BATCH = 5  # uneven micro-batches (2, 1, 1, 1), each with its own count of padded tokens


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models run fastest on one thread


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)


def _data(arch: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    if arch == "cnn":
        torch.manual_seed(3)
        return torch.randn(BATCH, 1, 28, 28), None, torch.randint(0, 10, (BATCH,))
    return batch_for(arch, batch=BATCH, padded=True)


def _model(arch: str) -> torch.nn.Module:
    return (tiny_cnn() if arch == "cnn" else tiny_model(arch)).train()


def _reference_loss(ref: torch.nn.Module, arch: str, inputs, mask, labels, parts: int) -> torch.Tensor:
    """The unsplit model's loss over the whole batch; with ``parts`` > 1, computed over micro-batches (logits
    concatenated), i.e. gradient accumulation with the whole batch's normalisation."""
    chunks = zip(split_batch(inputs, parts), split_batch(mask, parts))
    if arch == "cnn":
        logits = torch.cat([ref(x) for x, _ in chunks])
        return torch.nn.functional.cross_entropy(logits, labels)
    if parts == 1:
        return ref(input_ids=inputs, attention_mask=mask, labels=labels).loss
    logits = torch.cat([ref(input_ids=x, attention_mask=m).logits for x, m in chunks])
    return classification_loss(logits, labels) if arch == "bert" else causal_lm_loss(logits, labels)


def _train(arch: str, optimizer: str, trunk_server, ref_parts: int) -> tuple[float, float, object, RemoteTrunk]:
    model = _model(arch)
    ref = copy.deepcopy(model)
    inputs, mask, labels = _data(arch)
    split = split_model(model, (3, 6) if arch == "cnn" else (1, 3), micro_batches=PARTS)
    server = trunk_server(split.trunk, optimizer=optimizer, lr=0.05)
    remote = RemoteTrunk(server.address, insecure=True, channels=2)
    client = SplitModel(split.bottom, remote, split.top, task=split.task, micro_batches=PARTS)
    client_opt = make_optimizer(optimizer, split.client_modules().parameters(), 0.05)
    ref_opt = make_optimizer(optimizer, ref.parameters(), 0.05)
    loss_diff = 0.0
    for _ in range(STEPS):
        out = client(inputs, attention_mask=mask, labels=labels)
        out.loss.backward()
        client_opt.step()
        client_opt.zero_grad()
        ref_loss = _reference_loss(ref, arch, inputs, mask, labels, ref_parts)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_diff = max(loss_diff, abs(out.loss.item() - ref_loss.item()))
    remote.close()
    return _max_diff(model, ref), loss_diff, server, remote


@pytest.mark.parametrize("arch", ARCHS + ("cnn",))
def test_five_sgd_steps_with_micro_batches_equal_the_unpipelined_run(arch: str, trunk_server) -> None:
    weight_diff, loss_diff, server, remote = _train(arch, "sgd", trunk_server, ref_parts=1)
    assert weight_diff <= 1e-6
    assert loss_diff <= 1e-6
    # One contribution and one trunk step per client step, whatever the number of micro-batches.
    assert server.runtime.version == STEPS
    assert remote.outcomes == {"APPLIED": STEPS}
    assert server.runtime.micro.stats == {"parts": STEPS * PARTS, "steps": STEPS, "dropped": 0}


# Tied input and output embeddings (GPT-2, Gemma) sum their two uses in another order than one unsplit backward
# does: equal to rounding (see the SGD test), which AdamW then amplifies; they are not in this list.
UNTIED = ("llama", "qwen2", "qwen3", "mistral", "bert", "cnn")


@pytest.mark.parametrize("arch", UNTIED)
def test_five_adamw_steps_with_micro_batches_equal_unsplit_accumulation(arch: str, trunk_server) -> None:
    # AdamW divides by the gradient's running RMS, so the last-bit rounding of another summation order
    # (k micro-batches instead of one matmul over the batch) becomes a full-size step on parameters whose
    # true gradient is zero (BERT's key biases): the reference accumulates the same micro-batches in the
    # unsplit model, with the whole batch's normalisation; the split run then matches it bit for bit.
    weight_diff, loss_diff, server, remote = _train(arch, "adamw", trunk_server, ref_parts=PARTS)
    assert weight_diff <= 1e-6
    assert loss_diff <= 1e-6
    assert server.runtime.version == STEPS
    assert remote.outcomes == {"APPLIED": STEPS}


@pytest.mark.parametrize("arch, bound", [("gpt2", 1e-2), ("gemma", 1e-4)])
def test_five_adamw_steps_with_tied_embeddings_stay_near_unsplit_accumulation(arch: str, bound: float,
                                                                              trunk_server) -> None:
    # Not bit for bit (the README says so, with the figures: 3.7e-3 and 7.8e-6): the tied embedding's two
    # gradients add up in another order, which AdamW amplifies. The losses agree to rounding.
    weight_diff, loss_diff, server, remote = _train(arch, "adamw", trunk_server, ref_parts=PARTS)
    assert 0 < weight_diff <= bound
    assert loss_diff <= 1e-6
    assert server.runtime.version == STEPS and remote.outcomes == {"APPLIED": STEPS}


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_first_gradients_with_micro_batches_equal_the_full_batch(arch: str, trunk_server) -> None:
    model = _model(arch)
    ref = copy.deepcopy(model)
    inputs, mask, labels = _data(arch)
    split = split_model(model, (1, 3))
    server = trunk_server(split.trunk, optimizer="sgd", lr=0.01)
    client = SplitModel(split.bottom, RemoteTrunk(server.address, insecure=True), split.top, task=split.task,
                        micro_batches=PARTS)
    client(inputs, attention_mask=mask, labels=labels).loss.backward()
    ref(input_ids=inputs, attention_mask=mask, labels=labels).loss.backward()
    full = dict(ref.named_parameters())
    checked = 0
    for part in (split.bottom, split.top):
        for name, q in part.named_parameters():
            p = full[part.spec.full_key(name)]
            assert (q.grad - p.grad).abs().max().item() <= 1e-6, name
            checked += 1
    assert checked > 5
    client.trunk.close()


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_micro_batched_loss_is_normalised_over_the_whole_batch(arch: str) -> None:
    model = tiny_model(arch)
    inputs, mask, labels = batch_for(arch, batch=BATCH, padded=True)
    want = model(input_ids=inputs, attention_mask=mask, labels=labels).loss
    # The mean of micro-batch means differs when micro-batches hold different numbers of tokens: the test would
    # see it.
    means = [model(input_ids=x, attention_mask=m, labels=y).loss for x, m, y in
             zip(*(split_batch(t, PARTS) for t in (inputs, mask, labels)))]
    assert abs(torch.stack(means).mean().item() - want.item()) > 1e-4
    got = split_model(model, (1, 3), micro_batches=PARTS)(inputs, attention_mask=mask, labels=labels).loss
    assert abs(got.item() - want.item()) <= 1e-6


def test_evaluation_with_micro_batches_equals_the_full_batch(trunk_server) -> None:
    model = tiny_model("qwen2")
    inputs, mask, _ = batch_for("qwen2", batch=BATCH, padded=True)
    with torch.no_grad():
        want = model(input_ids=inputs, attention_mask=mask).logits
    split = split_model(model, (1, 3))
    server = trunk_server(split.trunk)
    remote = RemoteTrunk(server.address, insecure=True)
    client = SplitModel(split.bottom, remote, split.top, task=split.task, micro_batches=3).eval()
    with torch.no_grad():
        got = client(inputs, attention_mask=mask).logits
    assert (got - want)[mask.bool()].abs().max().item() <= 1e-5
    assert len(server.runtime.store) == 0  # evaluation forwards are not kept
    remote.close()


def test_micro_batches_config_rule() -> None:
    assert resolve_micro_batches("1", 16, 10**6) == 1
    assert resolve_micro_batches("3", 16, 10) == 3
    assert resolve_micro_batches("auto", 8, 1000) == 1  # 8 KB cut: per-call overhead dominates
    assert resolve_micro_batches("auto", 16, 512 * 768 * 2) == 4  # GPT-2 small, 16 x 512 tokens, bf16
    assert resolve_micro_batches("auto", 2, 10**8) == 2  # never more micro-batches than examples
    with pytest.raises(Exception, match="micro-batches"):
        resolve_micro_batches("0", 4, 10)


def _switch_cases() -> list:
    from test_config_switches import CASES

    # Dropout draws its masks per call: micro-batches draw other masks than the whole batch.
    return [pytest.param(c, id=str(c)) for c in CASES if "dropout" not in str(c)]


@pytest.mark.parametrize("case", _switch_cases())
def test_micro_batched_gradients_equal_unsplit_for_every_config_switch(case) -> None:
    # Local trunk: micro-batches one after another; every loss kind (causal LM, single-label, regression,
    # multi-label), token types and mask kinds, left or right padding, one micro-batch per example.
    from test_config_switches import batch as case_batch
    from test_config_switches import build

    # transformers' own sdpa path of bidirectional Gemma attends causally to a batch without padding (its mask
    # is dropped), so the unsplit model itself gives another answer per row than for the batch: eager there.
    model = build(case, "eager" if str(case) == "gemma-bidirectional" else None)
    ref = copy.deepcopy(model)
    inputs = case_batch(case, padded=True)
    want = ref(**inputs, **({} if case.arch == "bert" else {"use_cache": False}))
    got = split_model(model, cuts=(1, 3), micro_batches=3)(**inputs)
    assert abs(want.loss.item() - got.loss.item()) <= 1e-6
    want.loss.backward()
    got.loss.backward()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert (p.grad - q.grad).abs().max().item() <= 1e-6, name


def test_run_config_micro_batches_reach_the_client_model() -> None:
    from splitfed.client.round import micro_batches
    from splitfed.config import RunConfig
    from splitfed.errors import ConfigError
    from splitfed.models.parts import CLIENT_ROLES, build_parts

    split = build_parts(RunConfig.from_mapping({"model": "tiny-gpt2"}), CLIENT_ROLES)
    assert micro_batches(RunConfig.from_mapping({"micro-batches": "3"}), split) == 3
    hidden = split.config.hidden_size
    big = {"micro-batches": "auto", "batch-size": 16, "max-seq-len": 2 * (1 << 20) // (4 * hidden)}
    assert micro_batches(RunConfig.from_mapping(big), split) == 4  # 2 MiB per example, 16 examples
    assert micro_batches(RunConfig.from_mapping({"micro-batches": "auto", "batch-size": 2}), split) == 1
    from splitfed.channel.client.remote import RemoteTrunk

    on_host, remote = RemoteTrunk("127.0.0.1:1", insecure=True), RemoteTrunk("10.0.0.1:1", insecure=True)
    assert micro_batches(RunConfig.from_mapping(big), split, on_host) == 1  # the cut goes through shared memory
    assert micro_batches(RunConfig.from_mapping(big), split, remote) == 4
    assert micro_batches(RunConfig.from_mapping({**big, "micro-batches": "4"}), split, on_host) == 4  # as asked
    dp = {"micro-batches": "4", "dp-noise-multiplier": 1.0}
    assert micro_batches(RunConfig.from_mapping(dp), split) == 1  # DP-SGD runs whole batches
    with pytest.raises(ConfigError, match="trunk-batch-window-ms"):
        RunConfig.from_mapping({"micro-batches": "2", "trunk-batch-window-ms": 5.0})


def test_client_app_trains_with_micro_batches_like_without(trunk_server) -> None:
    # The Flower client's round (splitfed.client.round.client_train) with micro-batches = 4 against one trunk server,
    # and with 1 against another: the same client parts and trunk weights after the round.
    from flower_harness import default_run_config

    from splitfed.client.round import client_train
    from splitfed.config import RunConfig
    from splitfed.models.parts import build_parts, initial_client_state
    from splitfed.workload import load_splits

    base = default_run_config(local_steps=3, lr=0.05)
    results, trunks = {}, {}
    for k in ("1", "4"):
        cfg = RunConfig.from_mapping({**base, "micro-batches": k})
        split = build_parts(cfg)
        server = trunk_server(split.trunk, optimizer="sgd", lr=cfg.lr)
        remote = RemoteTrunk(server.address, insecure=True, channels=2)
        results[k] = client_train(cfg, initial_client_state(cfg, split), remote, load_splits(cfg, 0, 4),
                                  server_round=1, partition_id=0)
        trunks[k] = split.trunk
        assert server.runtime.version == 3 and results[k].metrics["train-steps"] == 3
        assert server.runtime.micro.stats["steps"] == (3 if k == "4" else 0)  # micro-batched steps reached it
        remote.close()
    for key, value in results["1"].state.items():
        assert (value - results["4"].state[key]).abs().max().item() <= 1e-6, key
    for p, q in zip(trunks["1"].parameters(), trunks["4"].parameters()):
        assert (p - q).abs().max().item() <= 1e-6
    assert results["4"].metrics["train-trunk-applied"] == 3


@pytest.mark.parametrize("before", [False, True])
def test_micro_batches_survive_lost_replies_and_never_apply_twice(trunk_server, before: bool) -> None:
    # Every Forward and Backward of every micro-batch loses its first reply (or fails before it runs); the client's
    # retries (over gRPC or its region's direct-call link), in flight on several channels at once, are answered from
    # what the first attempt left.
    from test_reliability import LoseReplies

    from splitfed.channel.client.trunk import RetryPolicy

    def train(interceptors: list) -> tuple[torch.nn.Module, object]:
        model = tiny_model("gpt2").train()
        split = split_model(model, cuts=(1, 3))
        server = trunk_server(split.trunk, optimizer="adamw", lr=0.01, interceptors=interceptors)
        remote = RemoteTrunk(server.address, insecure=True, retry=RetryPolicy(initial_backoff_s=0.05), channels=2)
        client = SplitModel(split.bottom, remote, split.top, task="causal-lm", micro_batches=PARTS)
        opt = torch.optim.AdamW(split.client_modules().parameters(), lr=0.01)
        ids, mask, labels = batch_for("gpt2", batch=BATCH, padded=True)
        for _ in range(3):
            client(ids, attention_mask=mask, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad()
        remote.close()
        return model, server

    clean, clean_server = train([])
    faults = LoseReplies(before=before)
    faulty, faulty_server = train([faults])
    assert faults.injected == faults.retries_seen == 3 * PARTS * 2
    assert faulty_server.runtime.version == clean_server.runtime.version == 3
    assert faulty_server.runtime.micro.stats == clean_server.runtime.micro.stats
    for (name, a), b in zip(clean.state_dict().items(), faulty.state_dict().values()):
        assert torch.equal(a, b), name
