"""SplitFed V1 (per-client trunk copies) and V2 (sequential turns) over the real split channel, checked against
unsplit models trained by hand: each V1 copy equals an unsplit model trained on its client's data alone and the
merge is the strategy's rule over the copies; V2's trunk equals one unsplit trunk trained client after client in
the round's seeded order; a silent client loses its turn after the timeout."""

from __future__ import annotations

import copy
import threading
import time

import numpy as np
import pytest
import torch
from conftest import tiny_cnn

from splitfed.channel.client.remote import RemoteTrunk
from splitfed.split import SplitModel, split_model
from splitfed.trunk.aggregation.percopy import PerClientAggregator
from splitfed.trunk.aggregation.turns import SequentialAggregator, turn_order

CUTS = (3, 6)
LR, MOMENTUM = 0.05, 0.9
STEPS = 3


def _sgd(params):  # type: ignore[no-untyped-def]
    return torch.optim.SGD(list(params), lr=LR, momentum=MOMENTUM)


def _data(i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Client ``i``'s batches: ``i + 2`` examples each, so the example weights differ."""
    g = torch.Generator().manual_seed(100 + i)
    return [(torch.randn(i + 2, 1, 28, 28, generator=g), torch.randint(0, 10, (i + 2,), generator=g))
            for _ in range(STEPS)]


def _trunk_params(model: torch.nn.Sequential) -> list[torch.Tensor]:
    return [p.detach() for p in model[CUTS[0]:CUTS[1]].parameters()]


def _client(global_model: torch.nn.Module, address: str, name: str) -> tuple[SplitModel, torch.optim.Optimizer]:
    parts = split_model(copy.deepcopy(global_model), CUTS)
    model = SplitModel(parts.bottom, RemoteTrunk(address, insecure=True, client_id=name), parts.top,
                       task=parts.task)
    return model, _sgd(parts.client_modules().parameters())


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    out = model(x, labels=y)
    opt.zero_grad()
    out.loss.backward()
    opt.step()


def _unsplit(global_model: torch.nn.Module, data: list) -> torch.nn.Sequential:  # type: ignore[type-arg]
    ref = copy.deepcopy(global_model)
    opt = _sgd(ref.parameters())
    for x, y in data:
        loss = torch.nn.functional.cross_entropy(ref(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return ref


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


def _v1_round(trunk_server, clients: int = 3, checkpointing: bool = False):  # type: ignore[no-untyped-def]
    """One V1 round of ``clients`` clients, steps interleaved; returns the global model, the server, the data."""
    model = tiny_cnn().train()
    agg = PerClientAggregator(_sgd)
    server = trunk_server(split_model(copy.deepcopy(model), CUTS).trunk, aggregator=agg, lr=LR,
                          checkpointing=checkpointing)
    names = [f"node-{i + 1}" for i in range(clients)]
    agg.begin_round(1, names)
    pairs = [_client(model, server.address, n) for n in names]
    data = [_data(i) for i in range(clients)]
    for step in range(STEPS):  # interleaved: each copy must still see only its own client's gradients
        for (m, opt), d in zip(pairs, data):
            _step(m, opt, *d[step])
    for m, _ in pairs:
        m.trunk.close()
    return model, server, agg, data


@pytest.mark.parametrize("checkpointing", [False, True], ids=["saved", "recomputed"])
def test_v1_each_copy_equals_its_client_alone_and_fedavg_merges_them_by_examples(trunk_server,
                                                                                 checkpointing: bool) -> None:
    from flwr.serverapp.strategy import FedAvg

    from strategies.trunk_copies import TrunkCopies

    model, server, agg, data = _v1_round(trunk_server, checkpointing=checkpointing)
    refs = [_unsplit(model, d) for d in data]
    trained = agg.trained()
    assert [c.client_id for c in trained] == ["node-1", "node-2", "node-3"]
    for copy_, ref in zip(trained, refs):
        assert _max_diff(list(copy_.state.values()), _trunk_params(ref)) <= 1e-6
    examples = [sum(len(y) for _, y in d) for d in data]
    assert [c.num_examples for c in trained] == examples
    assert agg.copies == 3 and agg.bytes_held > 0
    before = server.runtime.version

    TrunkCopies(FedAvg()).merge(1, server.runtime)

    total = sum(examples)
    expected = [sum(n / total * _trunk_params(r)[k] for n, r in zip(examples, refs))
                for k in range(len(_trunk_params(refs[0])))]
    assert _max_diff([p.detach() for p in server.runtime.trunk.parameters()], expected) <= 1e-6
    assert agg.copies == 0 and agg.bytes_held == 0  # freed at the round's end
    assert agg.stats["copies-freed"] == 3 and server.runtime.version == before + 1


@pytest.mark.parametrize("name", ["fedmedian", "krum"])
def test_v1_fedmedian_and_krum_merge_the_copies(trunk_server, name: str) -> None:
    from flwr.serverapp.strategy import FedMedian, Krum

    from strategies.trunk_copies import TrunkCopies

    _, server, agg, _ = _v1_round(trunk_server)
    copies = [[t.clone() for t in c.state.values()] for c in agg.trained()]
    TrunkCopies(FedMedian() if name == "fedmedian" else Krum()).merge(1, server.runtime)
    merged = [p.detach() for p in server.runtime.trunk.parameters()]
    if name == "fedmedian":
        expected = [torch.from_numpy(np.median(np.stack([c[k].numpy() for c in copies]), axis=0))
                    for k in range(len(merged))]
    else:  # Krum with f = 0 and 3 copies: the copy whose nearest other copy is closest
        flat = [torch.cat([t.flatten() for t in c]) for c in copies]
        scores = [min(float(((flat[i] - flat[j]) ** 2).sum()) for j in range(3) if j != i) for i in range(3)]
        expected = copies[int(np.argmin(scores))]
    assert _max_diff(merged, expected) <= 1e-6
    assert agg.copies == 0


def test_v1_refuses_a_client_that_is_not_in_the_round(trunk_server) -> None:
    from splitfed.errors import ChannelError

    model = tiny_cnn().train()
    agg = PerClientAggregator(_sgd)
    server = trunk_server(split_model(copy.deepcopy(model), CUTS).trunk, aggregator=agg, lr=LR)
    agg.begin_round(1, ["node-1"])
    m, opt = _client(model, server.address, "node-9")
    with pytest.raises(ChannelError, match="PERMISSION_DENIED"):
        _step(m, opt, *_data(0)[0])
    m.trunk.close()
    assert agg.copies == 0


def test_v2_order_is_a_seeded_permutation() -> None:
    clients = [f"node-{i}" for i in range(8)]
    first = turn_order(clients, seed=42, server_round=1)
    assert sorted(first) == sorted(clients)
    assert turn_order(list(reversed(clients)), seed=42, server_round=1) == first  # reproducible
    assert len({tuple(turn_order(clients, 42, r)) for r in range(1, 6)}) > 1  # a new order each round
    assert turn_order(clients, 7, 1) != first or turn_order(clients, 7, 2) != turn_order(clients, 42, 2)


def _train_alone(model: SplitModel, opt: torch.optim.Optimizer, data: list,  # type: ignore[type-arg]
                 errors: list) -> None:  # type: ignore[type-arg]
    try:
        client = model.trunk.client
        client.join()  # waits for this client's turn
        for x, y in data:
            _step(model, opt, x, y)
        client.leave()
        client.close()
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)


def test_v2_trunk_equals_unsplit_training_client_after_client_in_the_round_order(trunk_server) -> None:
    model = tiny_cnn().train()
    parts = split_model(copy.deepcopy(model), CUTS)
    agg = SequentialAggregator(seed=42, timeout=30)
    server = trunk_server(parts.trunk, aggregator=agg, lr=LR, momentum=MOMENTUM)
    names = ["node-1", "node-2", "node-3"]
    data = {n: _data(i) for i, n in enumerate(names)}
    agg.begin_round(1, names)
    order = list(agg.order)
    errors: list[BaseException] = []
    threads = [threading.Thread(target=_train_alone, args=(*_client(model, server.address, n), data[n], errors))
               for n in reversed(order)]  # they all ask at once, in the wrong order
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert agg.served == order and not agg.skipped

    # By hand: one trunk (and its optimizer) trained by each client's round-start bottom and top, in order.
    ref = split_model(copy.deepcopy(model), CUTS)
    trunk_opt = _sgd(ref.trunk.parameters())
    for n in order:
        bottom, top = copy.deepcopy(ref.bottom), copy.deepcopy(ref.top)
        local = torch.nn.Sequential(bottom, ref.trunk, top)
        part_opt = _sgd(list(bottom.parameters()) + list(top.parameters()))
        for x, y in data[n]:
            loss = torch.nn.functional.cross_entropy(local(x), y)
            part_opt.zero_grad()
            trunk_opt.zero_grad()
            loss.backward()
            part_opt.step()
            trunk_opt.step()
    got = [p.detach() for p in server.runtime.trunk.parameters()]
    assert _max_diff(got, [p.detach() for p in ref.trunk.parameters()]) <= 1e-6
    assert server.runtime.version == STEPS * len(names)


def test_v2_a_dead_client_is_skipped_after_the_timeout_and_the_round_finishes(trunk_server) -> None:
    model = tiny_cnn().train()
    agg = SequentialAggregator(seed=3, timeout=0.6)
    server = trunk_server(split_model(copy.deepcopy(model), CUTS).trunk, aggregator=agg, lr=LR)
    agg.begin_round(1, ["node-1", "node-2"])
    dead, live = agg.order  # the first in line never shows up
    errors: list[BaseException] = []
    start = time.monotonic()
    _train_alone(*_client(model, server.address, live), _data(0), errors)
    assert not errors, errors
    assert time.monotonic() - start >= 0.6
    assert agg.skipped == [dead] and agg.served == [live]
    assert agg.stats["skipped-turns"] == 1 and server.runtime.version == STEPS
    # The dead client comes back later: it is served after the others, not refused.
    late: list[BaseException] = []
    _train_alone(*_client(model, server.address, dead), _data(1), late)
    assert not late and agg.served == [live, dead]


def test_v1_copies_of_a_lora_trunk_hold_the_adapters_only_and_train_like_the_trunk_alone() -> None:
    """A LoRA trunk's copy is its adapters (and their optimizer state); a step on it equals a step of the trunk."""
    pytest.importorskip("peft")
    from conftest import tiny_model

    from splitfed.models.lora import apply_lora, lora_config
    from splitfed.split import CutState
    from splitfed.trunk.compute.runtime import TrunkRuntime

    trunk = split_model(tiny_model("llama").train(), (1, 3)).trunk
    apply_lora(trunk, lora_config("llama", 4), seed=0)
    alone = copy.deepcopy(trunk)
    for p in alone.parameters():  # peft starts B at zero: move off it so the step reaches A as well
        if p.requires_grad:
            p.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    trunk.load_state_dict(alone.state_dict())
    before = {n: p.detach().clone() for n, p in trunk.named_parameters()}
    adam = (lambda ps: torch.optim.AdamW(list(ps), lr=0.01))
    agg = PerClientAggregator(adam)
    runtime = TrunkRuntime(trunk, adam([p for p in trunk.parameters() if p.requires_grad]), aggregator=agg)
    hidden = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    grad = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))
    out, _ = runtime.forward("node-1", "a1", CutState(hidden), train=True, num_examples=2)
    runtime.backward("node-1", "a1", grad)

    (trained,) = agg.trained()
    adapters = {n for n, p in trunk.named_parameters() if p.requires_grad}
    assert set(trained.state) == adapters and all("lora_" in n for n in adapters)
    adapter_bytes = sum(p.numel() * 4 for n, p in trunk.named_parameters() if n in adapters)
    assert agg.bytes_held == 3 * adapter_bytes + 4 * len(adapters)  # weights, AdamW's two moments, its step counts
    opt = adam([p for p in alone.parameters() if p.requires_grad])
    ref = alone(CutState(hidden.clone())).hidden
    assert (ref.detach() - out).abs().max() <= 1e-6
    ref.backward(grad)
    opt.step()
    expected = [p.detach() for n, p in alone.named_parameters() if n in adapters]
    assert _max_diff(list(trained.state.values()), expected) <= 1e-6
    assert all(torch.equal(p, before[n]) for n, p in trunk.named_parameters() if n in adapters)  # until merged


def test_v1_micro_batches_of_one_step_step_the_copy_once_like_the_whole_batch() -> None:
    from splitfed.split import CutState
    from splitfed.trunk.aggregation.microsteps import StepPart
    from splitfed.trunk.compute.runtime import TrunkRuntime

    hidden = torch.randn(4, 4, 14, 14, generator=torch.Generator().manual_seed(0))
    copies = []
    for parts in (1, 2):
        trunk = split_model(tiny_cnn(), CUTS).trunk
        agg = PerClientAggregator(_sgd)
        runtime = TrunkRuntime(trunk, _sgd(trunk.parameters()), aggregator=agg)
        grad = torch.randn(4, 8, 7, 7, generator=torch.Generator().manual_seed(1))
        acts = [f"a{i}" for i in range(parts)]
        for act, h in zip(acts, hidden.chunk(parts)):
            runtime.forward("node-1", act, CutState(h), train=True, num_examples=len(h))
        for act, g in zip(acts, grad.chunk(parts)):
            runtime.backward("node-1", act, g, step=StepPart("s1", parts) if parts > 1 else None)
        (trained,) = agg.trained()
        assert trained.steps == 1 and trained.num_examples == 4
        copies.append(list(trained.state.values()))
    assert _max_diff(copies[0], copies[1]) <= 1e-6


def test_v2_nobody_is_skipped_before_any_client_of_the_round_shows_up() -> None:
    now = [0.0]
    agg = SequentialAggregator(seed=1, timeout=10, clock=lambda: now[0])
    agg.begin_round(1, ["node-1", "node-2"])
    first, second = agg.order
    now[0] = 100.0  # clients still starting: silence does not count yet
    agg.poll()
    assert agg.current == first and agg.deadline() is None
    waiting = agg.turn(second)  # a client shows life: the first one's timeout starts now
    assert not waiting.done() and agg.deadline() == 110.0
    now[0] = 109.0
    agg.poll()
    assert agg.current == first
    now[0] = 110.0
    agg.poll()
    assert agg.skipped == [first] and agg.current == second and waiting.done()
