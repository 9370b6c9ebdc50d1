"""The trunk takes the micro-batches of one client step as one contribution: sync, quorum and async steps,
staleness and the step count are those of the unpipelined step; bad step fields are refused with nothing changed."""

from __future__ import annotations

import copy
import uuid

import grpc
import pytest
import torch
from conftest import tiny_model

from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.client.trunk import PART_OUTCOME, TrunkClient
from splitfed.errors import ActivationStateError, ChannelError, CodecError
from splitfed.split import CutState, split_model
from splitfed.trunk.aggregation.modes import Outcome, make_aggregator
from splitfed.trunk.aggregation.microsteps import StepPart
from splitfed.trunk.compute.runtime import TrunkRuntime


def _runtime(mode: str = "sync", **kwargs: object) -> TrunkRuntime:
    split = split_model(tiny_model("llama", layers=2).train(), cuts=(1, 2))
    return TrunkRuntime(split.trunk, torch.optim.SGD(split.trunk.parameters(), lr=0.1),
                        aggregator=make_aggregator(mode, timeout=30.0, **kwargs))


def _forward(rt: TrunkRuntime, client: str, hidden: torch.Tensor, act: str | None = None) -> str:
    act = act or uuid.uuid4().hex
    rt.forward(client, act, CutState(hidden), train=True, num_examples=int(hidden.shape[0]))
    return act


def test_parts_answer_at_once_and_the_last_one_steps_the_trunk_once() -> None:
    rt = _runtime("async")
    step = StepPart("s1", 3)
    hidden = torch.randn(3, 4, 32)
    acts = [_forward(rt, "a", hidden[i:i + 1], f"s1.{i}") for i in range(3)]
    results = [rt.start_backward("a", act, torch.ones(1, 4, 32), step=step) for act in acts]
    assert [r.result.done() for r in results] == [True, True, True]
    assert [r.result.result().outcome for r in results] == [Outcome.PART, Outcome.PART, Outcome.APPLIED]
    assert all(r.grad_in.result().shape == (1, 4, 32) for r in results)
    assert rt.version == 1
    assert rt.micro.stats == {"parts": 3, "steps": 1, "dropped": 0}


def test_a_step_in_parts_updates_the_trunk_like_the_whole_batch() -> None:
    whole, parts = _runtime("async"), _runtime("async")
    parts.trunk.load_state_dict(whole.trunk.state_dict())
    torch.manual_seed(0)
    hidden, grad = torch.randn(4, 5, 32), torch.randn(4, 5, 32)
    act = _forward(whole, "a", hidden)
    want_in = whole.backward("a", act, grad).grad_in
    got_in = []
    for i in range(2):
        a = _forward(parts, "a", hidden[2 * i:2 * i + 2], f"p.{i}")
        got_in.append(parts.backward("a", a, grad[2 * i:2 * i + 2], step=StepPart("p", 2)).grad_in)
    assert (torch.cat(got_in) - want_in).abs().max().item() <= 1e-6
    for (name, p), q in zip(whole.trunk.named_parameters(), parts.trunk.parameters()):
        assert (p - q).abs().max().item() <= 1e-6, name
    assert whole.version == parts.version == 1


def test_sync_step_waits_for_every_part_and_every_member() -> None:
    rt = _runtime("sync")
    rt.join("a"), rt.join("b")
    step = StepPart("s", 2)
    a0, a1 = (_forward(rt, "a", torch.randn(1, 3, 32), f"s.{i}") for i in range(2))
    b = _forward(rt, "b", torch.randn(2, 3, 32))
    first = rt.start_backward("a", a0, torch.ones(1, 3, 32), step=step)
    assert first.result.result().outcome is Outcome.PART  # answered at once, the trunk has not stepped
    last = rt.start_backward("a", a1, torch.ones(1, 3, 32), step=step)
    assert not last.result.done() and rt.version == 0  # the sync step still waits for b
    other = rt.start_backward("b", b, torch.ones(2, 3, 32))
    assert last.result.result().outcome is Outcome.APPLIED and other.result.result().outcome is Outcome.APPLIED
    assert rt.version == 1
    assert rt.aggregator.stats["applied"] == 2  # two contributions, one per client


def test_quorum_counts_a_step_in_parts_once() -> None:
    rt = _runtime("quorum", quorum=2)
    for c in "abc":
        rt.join(c)
    step = StepPart("q", 3)
    acts = [_forward(rt, "a", torch.randn(1, 3, 32), f"q.{i}") for i in range(3)]
    for act in acts:
        rt.start_backward("a", act, torch.ones(1, 3, 32), step=step)
    assert rt.version == 0  # three parts of one client are one contribution: the quorum of 2 is not reached
    b = _forward(rt, "b", torch.randn(1, 3, 32))
    rt.start_backward("b", b, torch.ones(1, 3, 32))
    assert rt.version == 1


def test_staleness_is_that_of_the_oldest_part() -> None:
    rt = _runtime("async", max_staleness=4)
    old = _forward(rt, "a", torch.randn(1, 3, 32), "st.0")
    rt.backward("b", _forward(rt, "b", torch.randn(1, 3, 32)), torch.ones(1, 3, 32))  # the trunk steps
    new = _forward(rt, "a", torch.randn(1, 3, 32), "st.1")
    rt.start_backward("a", old, torch.ones(1, 3, 32), step=StepPart("st", 2))
    result = rt.start_backward("a", new, torch.ones(1, 3, 32), step=StepPart("st", 2)).result.result()
    assert result.staleness == 1 and result.outcome is Outcome.APPLIED
    assert rt.version == 2


def test_a_part_count_that_changes_is_refused_with_nothing_consumed() -> None:
    rt = _runtime("async")
    a0, a1 = (_forward(rt, "a", torch.randn(1, 3, 32), f"m.{i}") for i in range(2))
    rt.start_backward("a", a0, torch.ones(1, 3, 32), step=StepPart("m", 2))
    with pytest.raises(CodecError, match="same step_parts"):
        rt.start_backward("a", a1, torch.ones(1, 3, 32), step=StepPart("m", 3))
    assert rt.store.find(a1) is not None  # the saved forward is still there
    rt.start_backward("a", a1, torch.ones(1, 3, 32), step=StepPart("m", 2))
    assert rt.version == 1


def test_a_new_step_or_leaving_drops_the_incomplete_one() -> None:
    rt = _runtime("async")
    rt.start_backward("a", _forward(rt, "a", torch.randn(1, 3, 32)), torch.ones(1, 3, 32), step=StepPart("x", 2))
    rt.start_backward("a", _forward(rt, "a", torch.randn(1, 3, 32)), torch.ones(1, 3, 32), step=StepPart("y", 2))
    assert rt.micro.stats["dropped"] == 1 and rt.micro.pending == 1 and rt.version == 0
    rt.leave("a")
    assert rt.micro.stats["dropped"] == 2 and rt.micro.pending == 0 and rt.version == 0


def test_step_fields_are_checked() -> None:
    assert StepPart.of("", 0) is None and StepPart.of("s", 1) is None
    for step_id, parts in (("", 2), ("s", -1), ("s", 10**6), ("x" * 200, 2)):
        with pytest.raises(CodecError):
            StepPart.of(step_id, parts)


def test_a_batched_forward_cannot_be_a_micro_batch() -> None:
    from splitfed.trunk.compute.requests import ForwardRequest

    rt = _runtime("sync")
    requests = [ForwardRequest(c, f"{c}-1", CutState(torch.randn(1, 3, 32)), True, 1) for c in "ab"]
    rt.forward_many(requests)
    with pytest.raises(ActivationStateError, match="trunk-batch-window-ms"):
        rt.start_backward("a", "a-1", torch.ones(1, 3, 32), step=StepPart("b", 2))
    assert rt.store.find("a-1") is not None


def test_over_grpc_parts_and_bad_step_fields(trunk_server) -> None:
    split = split_model(tiny_model("llama", layers=2).train(), cuts=(1, 2))
    server = trunk_server(split.trunk, aggregator=make_aggregator("async", timeout=30.0), optimizer="sgd", lr=0.1)
    before = copy.deepcopy(split.trunk.state_dict())
    client = TrunkClient(server.address, insecure=True, client_id="c", channels=2)
    acts = [f"g.{i}" for i in range(2)]
    for act in acts:
        client.forward(CutState(torch.randn(1, 3, 32)), activation_id=act)
    with pytest.raises(ChannelError) as err:
        client.backward(acts[0], torch.ones(1, 3, 32), step_id="", step_parts=2)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT.name
    assert all(torch.equal(v, split.trunk.state_dict()[k]) for k, v in before.items())
    futures = [client.submit(client.backward, act, torch.ones(1, 3, 32), step_id="g", step_parts=2)
               for act in acts]
    outcomes = sorted(f.result().outcome for f in futures)
    assert outcomes == sorted(["APPLIED", PART_OUTCOME])
    assert server.runtime.version == 1
    assert pb.UpdateOutcome.Value(PART_OUTCOME) == pb.UPDATE_OUTCOME_UNSPECIFIED
    client.close()
