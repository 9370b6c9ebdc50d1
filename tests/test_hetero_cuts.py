"""Heterogeneous cut depth per client: the merge rule, the trunk running a client's own blocks, the gradient of a
block only some clients use, and a 2-client sync round over gRPC checked against a hand computation."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from conftest import ARCHS, batch_for, tiny_model
from torch import nn

from splitfed.config import RunConfig
from splitfed.split.cutmerge import Copy, complete_state, merge_copies, natural_key, trunk_copy_examples
from splitfed.errors import ConfigError, SplitError
from splitfed.models.hetero import (
    CutPlan,
    client_config,
    full_state,
    load_full_state,
    load_trunk_blocks,
    node_cut,
    seed_adapters_by_block,
    server_config,
    trunk_blocks,
)
from splitfed.split import CutState, SplitModel, requested_blocks, split_model
from splitfed.trunk.aggregation.contributions import Contribution, weighted_mean


# -- the merge rule (pure) ------------------------------------------------------------------------------------
def test_merge_copies_is_the_example_weighted_mean_of_the_holders() -> None:
    c1 = Copy({"0.w": torch.tensor([1.0, 2.0]), "3.w": torch.tensor([4.0])}, 10)
    c2 = Copy({"0.w": torch.tensor([3.0, 6.0]), "1.w": torch.tensor([8.0]), "3.w": torch.tensor([0.0])}, 30)
    trunk = Copy({"1.w": torch.tensor([0.0]), "2.w": torch.tensor([5.0])}, 10)  # ran block 1 for c1 only
    merged = merge_copies([c1, c2, trunk])
    assert list(merged) == ["0.w", "1.w", "2.w", "3.w"]
    assert torch.allclose(merged["0.w"], torch.tensor([2.5, 5.0]))  # (10*1 + 30*3) / 40
    assert torch.allclose(merged["1.w"], torch.tensor([6.0]))  # (30*8 + 10*0) / 40
    assert torch.equal(merged["2.w"], torch.tensor([5.0]))  # the trunk's copy alone
    assert torch.allclose(merged["3.w"], torch.tensor([1.0]))
    with pytest.raises(SplitError, match="at least one example"):
        merge_copies([Copy({"a": torch.ones(1)}, 0)])


def test_fedavg_of_completed_replies_is_the_merge_rule() -> None:
    # Flower's FedAvg over whole-model replies (client parts + the trunk's copy of [a, b)) equals the rule with
    # the trunk's copy weighted by the examples of the clients it ran the block for.
    from flwr.app import ArrayRecord, MetricRecord, RecordDict
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    g = torch.Generator().manual_seed(0)
    blocks = 5
    cuts, examples = [(1, 3), (2, 4), (3, 4)], [12.0, 30.0, 7.0]
    trunk = {f"{k}.w": torch.randn(3, generator=g) for k in range(1, 4)}
    clients = [{f"{k}.w": torch.randn(3, generator=g) for k in range(blocks) if not a <= k < b} for a, b in cuts]
    completed = [complete_state(own, {k: v for k, v in trunk.items() if a <= int(k[0]) < b})
                 for own, (a, b) in zip(clients, cuts)]
    assert all(list(c) == [f"{k}.w" for k in range(blocks)] for c in completed)
    records = [RecordDict({"arrays": ArrayRecord(torch_state_dict=c), "metrics": MetricRecord({"num-examples": n})})
               for c, n in zip(completed, examples)]
    fedavg = aggregate_arrayrecords(records, "num-examples").to_torch_state_dict()
    copies = [Copy(own, n) for own, n in zip(clients, examples)]
    for k in range(1, 4):
        n_k = trunk_copy_examples(cuts, examples, k)
        copies.append(Copy({f"{k}.w": trunk[f"{k}.w"]}, n_k))
    rule = merge_copies(copies)
    assert fedavg.keys() == rule.keys()
    assert max((fedavg[k] - rule[k]).abs().max().item() for k in rule) <= 1e-6
    assert trunk_copy_examples(cuts, examples, 3) == 37.0 and trunk_copy_examples(cuts, examples, 0) == 0.0


def test_complete_state_refuses_a_block_both_hold_and_orders_blocks_numerically() -> None:
    with pytest.raises(SplitError, match="both hold"):
        complete_state({"1.w": torch.ones(1)}, {"1.w": torch.ones(1)})
    assert sorted(["layers.10.a", "layers.9.a", "layers.1.a"], key=natural_key) == \
        ["layers.1.a", "layers.9.a", "layers.10.a"]


# -- cuts: plan, node override, channel range ------------------------------------------------------------------
def test_cut_plan_round_robin_node_override_and_trunk_range() -> None:
    cfg = RunConfig(client_cuts="1,6 4,9", cuts=(3, 6))
    assert CutPlan.from_config(cfg).trunk_range == (1, 9)
    assert server_config(cfg).cuts == (1, 9)
    assert [node_cut(cfg, p) for p in range(3)] == [(1, 6), (4, 9), (1, 6)]
    assert node_cut(cfg, 0, {"cuts": "'2,7'"}) == (2, 7)
    assert client_config(cfg, 1, {}).cuts == (4, 9)
    assert node_cut(RunConfig(), 0) is None and client_config(RunConfig(), 0).cuts is None
    with pytest.raises(ConfigError, match="one 'a,b' pair"):
        node_cut(cfg, 0, {"cuts": "1,2 3,4"})
    for bad in ("3,1", "2,2"):
        with pytest.raises(ConfigError, match="0 < a < b"):
            RunConfig.from_mapping({"client-cuts": bad})


@pytest.mark.parametrize("cut, error", [((0, 0), None), ((1, 3), None), ((2, 2), None), ((2, 3), None),
                                        ((0, 3), "outside"), ((1, 4), "outside"), ((3, 2), "cut_start 3 > cut_end 2")])
def test_requested_blocks_validates_a_cut_against_the_trunk(cut, error) -> None:
    if error is None:
        want = (1, 3) if cut == (0, 0) else cut
        assert requested_blocks(*cut, (1, 3)) == want
    else:
        with pytest.raises(SplitError, match=error):
            requested_blocks(*cut, (1, 3))


# -- the trunk runs a sub-range exactly ------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_trunk_sub_range_equals_the_trunk_of_that_cut(arch: str) -> None:
    model = tiny_model(arch, layers=4)
    wide = split_model(copy.deepcopy(model), (1, 4))
    narrow = split_model(copy.deepcopy(model), (2, 3))
    ids, mask, _ = batch_for(arch, padded=True)
    with torch.no_grad():
        state = narrow.bottom(ids, attention_mask=mask)  # blocks [0, 2)
        want = narrow.trunk(state).hidden
        got = wide.trunk(CutState(state.hidden, state.attention_mask, state.position_ids, (2, 3))).hidden
    assert (got - want).abs().max().item() <= 1e-6
    with pytest.raises(SplitError, match="outside"):
        wide.trunk(CutState(state.hidden, state.attention_mask, state.position_ids, (0, 2)))


def test_sequential_trunk_sub_range_and_empty_range() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(4)])
    trunk = split_model(model, (1, 4)).trunk
    x = torch.randn(3, 4)
    assert torch.equal(trunk(CutState(x, blocks=(2, 3))).hidden, model[2](x))
    assert torch.equal(trunk(CutState(x, blocks=(3, 3))).hidden, x)


# -- gradients of a block only some clients use ----------------------------------------------------------------
def test_weighted_mean_divides_each_parameter_by_the_examples_that_touched_it() -> None:
    a = Contribution("a", 0, [torch.tensor([1.0]), torch.tensor([2.0])], num_examples=1)
    b = Contribution("b", 0, [None, torch.tensor([5.0])], num_examples=3)  # b's cut skips the first block
    first, second = weighted_mean([a, b])
    assert torch.equal(first, torch.tensor([1.0]))  # a's gradient alone, not a quarter of it
    assert torch.allclose(second, torch.tensor([(1 * 2.0 + 3 * 5.0) / 4]))


# -- LoRA adapters start the same whichever part holds a block -------------------------------------------------
def test_adapters_seeded_by_block_match_across_cuts() -> None:
    from splitfed.models.lora import apply_lora, lora_config

    model = tiny_model("llama", layers=4)
    a = split_model(copy.deepcopy(model), (1, 3))
    b = split_model(copy.deepcopy(model), (2, 3))
    config = lora_config("llama", 2)
    for i, split in enumerate((a, b)):
        for role in ("bottom", "trunk", "top"):
            part = getattr(split, role)
            apply_lora(part, config, seed=10 * i + len(role))  # different per-part seeds on purpose
            seed_adapters_by_block(part, 42)
    in_trunk = full_state([a.trunk])
    in_bottom = full_state([b.bottom])
    shared = [k for k in in_trunk if k.startswith("model.layers.1.")]
    assert shared and all(torch.equal(in_trunk[k], in_bottom[k]) for k in shared)


# -- a 2-client sync round over gRPC, cuts (1, 3) and (2, 3) ---------------------------------------------------
D, CLASSES, STEPS, LR = 6, 3, 4, 0.2
BATCH = {(1, 3): 4, (2, 3): 6}


def _blocks_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(3)], nn.Linear(D, CLASSES))


def _data(cut: tuple[int, int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(cut[0])
    n = BATCH[cut]
    return [(torch.randn(n, D, generator=g), torch.randint(0, CLASSES, (n,), generator=g)) for _ in range(STEPS)]


def _reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The round written out by hand: each client steps its own blocks on its own loss; the trunk steps block 2
    on the example-weighted mean of both clients' gradients and block 1 on client (1, 3)'s alone."""
    base = _blocks_model()
    c1, c2, trunk = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    d1, d2 = _data((1, 3)), _data((2, 3))
    n1, n2 = BATCH[(1, 3)], BATCH[(2, 3)]
    for (x1, y1), (x2, y2) in zip(d1, d2):
        loss1 = nn.functional.cross_entropy(c1[3](trunk[2](trunk[1](c1[0](x1)))), y1)
        loss2 = nn.functional.cross_entropy(c2[3](trunk[2](c2[1](c2[0](x2)))), y2)
        own1 = [*c1[0].parameters(), *c1[3].parameters()]
        own2 = [*c2[0].parameters(), *c2[1].parameters(), *c2[3].parameters()]
        t1, t2 = list(trunk[1].parameters()), list(trunk[2].parameters())
        g1 = torch.autograd.grad(loss1, own1 + t1 + t2)
        g2 = torch.autograd.grad(loss2, own2 + t2)
        with torch.no_grad():
            for p, g in zip(own1, g1[:len(own1)]):
                p -= LR * g
            for p, g in zip(own2, g2[:len(own2)]):
                p -= LR * g
            for p, g in zip(t1, g1[len(own1):len(own1) + len(t1)]):
                p -= LR * g  # only client (1, 3) used block 1 through the trunk
            for p, ga, gb in zip(t2, g1[len(own1) + len(t1):], g2[len(own2):]):
                p -= LR * (n1 * ga + n2 * gb) / (n1 + n2)
    return c1.state_dict(), c2.state_dict(), trunk.state_dict()


def _client(address: str, cut: tuple[int, int], start: threading.Barrier, out: dict, model: nn.Module) -> None:
    from splitfed.channel.client.remote import RemoteTrunk

    split = split_model(model, cut)
    remote = RemoteTrunk(address, insecure=True, client_id=f"client-{cut[0]}", cut=cut)
    model = SplitModel(split.bottom, remote, split.top, task="classification")
    optimizer = torch.optim.SGD(split.client_modules().parameters(), lr=LR)
    remote.client.join()
    start.wait(timeout=30)
    for x, y in _data(cut):
        model(x, labels=y).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    out[cut] = (full_state([split.bottom, split.top]), STEPS * BATCH[cut], dict(remote.outcomes))
    remote.close()


def test_two_clients_sync_cuts_1_3_and_2_3_merge_equals_hand_computation(trunk_server) -> None:
    from flwr.app import ArrayRecord, MetricRecord, RecordDict
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    server = trunk_server(split_model(_blocks_model(), (1, 3)).trunk, optimizer="sgd", lr=LR, cuts=(1, 3))
    out: dict = {}
    start = threading.Barrier(2)
    # Built here, not in the threads: _blocks_model seeds torch's global RNG, which the threads would share.
    models = {cut: _blocks_model() for cut in BATCH}
    threads = [threading.Thread(target=_client, args=(server.address, cut, start, out, models[cut])) for cut in BATCH]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert set(out) == set(BATCH), "a client failed"
    assert all(outcomes == {"APPLIED": STEPS} for _, _, outcomes in out.values())
    assert server.runtime.version == STEPS  # one sync step per local step of both clients

    r1, r2, rt = _reference()
    # The trunk trained block 2 on both clients' gradients and block 1 on client (1, 3)'s alone.
    trained = trunk_blocks(server.runtime, 1, 3)
    assert max((trained[k] - rt[k]).abs().max().item() for k in trained) <= 1e-6
    # The server's merge: each reply completed with the trunk's copy of its [a, b), averaged by FedAvg.
    records = []
    for (a, b), (own, n, _) in out.items():
        completed = complete_state(own, trunk_blocks(server.runtime, a, b))
        records.append(RecordDict({"arrays": ArrayRecord(torch_state_dict=completed),
                                   "metrics": MetricRecord({"num-examples": n})}))
    merged = aggregate_arrayrecords(records, "num-examples").to_torch_state_dict()
    # By hand: block 0 and 3 from both clients; block 1 from client (2, 3) and the trunk's copy, which stands for
    # client (1, 3)'s examples; block 2 is the trunk's alone.
    e1, e2 = STEPS * BATCH[(1, 3)], STEPS * BATCH[(2, 3)]
    want = {}
    for key in r1:
        block = int(key.split(".")[0])
        first = r1[key] if block in (0, 3) else rt[key]
        second = r2[key] if block != 2 else rt[key]
        want[key] = (e1 * first + e2 * second) / (e1 + e2)
    assert merged.keys() == want.keys()
    assert max((merged[k] - want[k]).abs().max().item() for k in want) <= 1e-6
    # Every holder starts the next round from the merged version.
    load_trunk_blocks(server.runtime, merged)
    now = trunk_blocks(server.runtime, 1, 3)
    assert all(torch.equal(now[k], merged[k]) for k in now)
    nxt = split_model(_blocks_model(), (2, 3))
    load_full_state([nxt.bottom, nxt.top], merged)
    assert torch.equal(nxt.bottom.layers[1][0].weight, merged["1.0.weight"])


# -- the ServerApp, ClientApp and SplitFed strategy with client-cuts (in process) ------------------------------
def test_apps_with_client_cuts_merge_every_block_and_give_the_trunk_its_share(tmp_path, monkeypatch) -> None:
    import json

    from flower_harness import run_apps

    from apps import server_app
    from splitfed.models.parts import build_parts
    from strategies import build_strategy
    from strategies import run as splitfed_run_module

    seen: dict[str, list] = {"replies": [], "result": []}
    runners: list = []

    def spied(cfg: RunConfig):
        strategy = build_strategy(cfg)
        aggregate = strategy.aggregate_train

        def aggregate_train(server_round, replies):  # type: ignore[no-untyped-def]
            replies = list(replies)
            seen["replies"].append([(r.content["arrays"].to_torch_state_dict(),
                                     float(r.content["metrics"]["num-examples"])) for r in replies])
            arrays, metrics = aggregate(server_round, replies)
            seen["result"].append(arrays.to_torch_state_dict())
            return arrays, metrics
        strategy.aggregate_train = aggregate_train
        return strategy

    original = splitfed_run_module.ServerRunner  # splitfed_run builds the trunk server

    def runner(*args, **kwargs):  # type: ignore[no-untyped-def]
        runners.append(original(*args, **kwargs))
        return runners[-1]

    monkeypatch.setattr(server_app, "build_strategy", spied)
    monkeypatch.setattr(splitfed_run_module, "ServerRunner", runner)
    _, out = run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=1, local_steps=5,
                      client_cuts="1,6 4,9")
    history = json.loads((out / "history.json").read_text())
    assert history["status"] == "completed" and history["config"]["cuts"] == "1,9"
    trunk_runtime = runners[0].runtime
    assert trunk_runtime.trunk.spec.first_layer == 1 and trunk_runtime.trunk.spec.num_layers == 8
    # Every reply reached the strategy as a whole model (all of the CNN's tensors, unsplit names).
    split = build_parts(server_config(RunConfig(client_cuts="1,6 4,9")))
    whole = full_state([split.bottom, split.trunk, split.top])
    replies = seen["replies"][0]
    assert all(list(state) == sorted(whole, key=natural_key) for state, _ in replies)
    # The aggregate is the example-weighted mean of the completed replies, and the trunk now holds its blocks.
    total = sum(n for _, n in replies)
    result = seen["result"][0]
    for key in whole:
        want = sum(state[key] * n for state, n in replies) / total
        assert (result[key] - want).abs().max().item() <= 1e-6
    held = trunk_blocks(trunk_runtime, 1, 9)
    assert set(held) == {"3.weight", "3.bias", "7.weight", "7.bias"}
    assert all(torch.equal(held[k], result[k]) for k in held)
    assert history["rounds"][0]["evaluate"]["num-examples"] == 1000


def test_lora_run_with_client_cuts_exports_the_merged_model(tmp_path) -> None:
    # A pretrained-style checkpoint (tiny Llama), LoRA on every part, clients with cuts (1, 3) and (2, 3): the
    # exported model computes what the split model with the merged adapters (global state + trunk) computes.
    import json

    from flower_harness import run_apps
    from llm_fixtures import VOCAB, save_tiny
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from splitfed.models.parts import ALL_ROLES, build_parts

    folder = save_tiny("llama", tmp_path / "ckpt")
    settings = {"model": str(folder), "client_cuts": "1,3 2,3", "lora_rank": 4, "max_seq_len": 32, "batch_size": 4,
                "lr": 0.01, "optimizer": "adamw", "eval_batches": 2}
    _, out = run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=1, local_steps=3, **settings)
    history = json.loads((out / "history.json").read_text())
    assert history["status"] == "completed" and history["config"]["cuts"] == "1,3"
    cfg = server_config(RunConfig.from_mapping({k.replace("_", "-"): v for k, v in settings.items()}))
    split = build_parts(cfg, ALL_ROLES)
    merged = load_file(str(out / "checkpoint" / "clients.safetensors"))
    assert any(k.startswith("model.layers.1.") for k in merged)  # block 1: client (2, 3)'s copy and the trunk's
    load_full_state([split.bottom, split.top], merged)
    split.trunk.load_state_dict(load_file(str(out / "checkpoint" / "trunk.safetensors")), strict=False)
    trunk_now = full_state([split.trunk])
    assert all(torch.equal(trunk_now[k], merged[k]) for k in trunk_now)  # the trunk holds the merged version
    ids, mask, _ = batch_for("llama", padded=True)
    ids = ids.clamp(max=VOCAB - 4)
    exported = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    with torch.no_grad():
        want = split.eval()(ids, attention_mask=mask).logits
        got = exported(input_ids=ids, attention_mask=mask).logits
    assert (got - want)[mask.bool()].abs().max().item() < 1e-5


def test_node_config_cuts_override_client_cuts(tmp_path, monkeypatch) -> None:
    # Partition 1 says cuts='3,6' in its node config; the plan would give it 1,6.
    import flower_harness
    from flower_harness import run_apps

    from strategies import cuts

    grid_init = flower_harness.ThreadGrid.__init__

    def init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        grid_init(self, *args, **kwargs)
        self.contexts[101].node_config["cuts"] = "'3,6'"

    seen: list[tuple[int, int]] = []
    reply_cut = cuts.reply_cut
    monkeypatch.setattr(flower_harness.ThreadGrid, "__init__", init)
    monkeypatch.setattr(cuts, "reply_cut", lambda reply: seen.append(reply_cut(reply)) or seen[-1])
    run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=1, local_steps=3, client_cuts="1,6")
    assert sorted(seen) == [(1, 6), (3, 6)]
