"""Cross-client batching of trunk work: the same outputs, input gradients and weights as one call per client."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch
from conftest import tiny_model

from splitfed.channel.client.trunk import TrunkClient
from splitfed.split import CutState, split_model
from splitfed.trunk.aggregation.modes import make_aggregator
from splitfed.trunk.compute.batching import pack

LENGTHS = (5, 9, 3, 7)  # four clients, four sequence lengths


def _inputs(arch: str, step: int) -> list[CutState]:
    g = torch.Generator().manual_seed(100 + step)
    states = []
    for i, length in enumerate(LENGTHS):
        hidden = torch.randn(2, length, 32, generator=g)
        mask = torch.ones(2, length, dtype=torch.long)
        if i == 1:  # one client pads its own batch (left for decoders, right for BERT)
            if arch == "bert":
                mask[1, -3:] = 0
            else:
                mask[1, :3] = 0
        positions = None
        if arch == "llama":
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
        states.append(CutState(hidden, mask if i % 2 else None, positions))
    return states


def _run(trunk_server, arch: str, window_ms: float, steps: int = 1):
    torch.manual_seed(0)
    split = split_model(tiny_model(arch).train(), cuts=(1, 3))
    server = trunk_server(split.trunk, lr=0.1, aggregator=make_aggregator("sync", timeout=60),
                          batch_window_ms=window_ms)
    outs: dict = {}
    start = threading.Barrier(len(LENGTHS))

    def client(i: int) -> None:
        c = TrunkClient(server.address, insecure=True, client_id=f"c{i}")
        c.join()
        for step in range(steps):
            state = _inputs(arch, step)[i]
            start.wait(30)  # all forwards arrive within the window
            act = uuid.uuid4().hex
            out, _ = c.forward(state, activation_id=act, train=True, num_examples=2 + i)
            grad = torch.sin(out * (1 + i))  # a different gradient per client
            reply = c.backward(act, grad)
            outs[(i, step)] = (out, reply.grad, reply.outcome)
        c.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(LENGTHS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return split.trunk, server, outs


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_batched_sync_steps_equal_one_call_per_client(trunk_server, arch: str) -> None:
    trunk, server, outs = _run(trunk_server, arch, window_ms=0)
    b_trunk, b_server, b_outs = _run(trunk_server, arch, window_ms=500)
    assert len(outs) == len(b_outs) == len(LENGTHS)
    assert b_server.runtime._batches.stats["group-backwards"] >= 1  # batching really happened
    assert b_server.scheduler.stats["forward-batches"] >= 1 and server.scheduler.stats["forward-batches"] == 0
    for key, (out, grad_in, outcome) in outs.items():
        b_out, b_grad, b_outcome = b_outs[key]
        assert outcome == b_outcome == "APPLIED"
        assert out.shape == b_out.shape and grad_in.shape == b_grad.shape
        assert torch.allclose(out, b_out, atol=1e-6, rtol=1e-6), key
        assert torch.allclose(grad_in, b_grad, atol=1e-6, rtol=1e-6), key
    assert server.runtime.version == b_server.runtime.version == 1
    for (name, a), b in zip(trunk.state_dict().items(), b_trunk.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-6), name


def test_batched_evaluation_forwards_equal_alone_in_every_mode(trunk_server) -> None:
    split = split_model(tiny_model("llama").eval(), cuts=(1, 3))
    server = trunk_server(split.trunk, aggregator=make_aggregator("async"), batch_window_ms=300)
    states = _inputs("llama", 0)
    results: dict = {}
    start = threading.Barrier(len(states))

    def client(i: int) -> None:
        c = TrunkClient(server.address, insecure=True, client_id=f"e{i}")
        start.wait(30)
        results[i] = c.forward(states[i], train=False)[0]
        c.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(states))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert server.runtime._batches.stats["batched-calls"] >= 1
    with torch.no_grad():
        for i, state in enumerate(states):
            assert torch.allclose(results[i], split.trunk(state).hidden, atol=1e-6), i


def test_packing_pads_right_and_takes_each_clients_rows_back() -> None:
    states = _inputs("llama", 0)
    packed = pack(states)
    assert packed.state.hidden.shape == (8, max(LENGTHS), 32)
    assert packed.state.attention_mask is not None and packed.state.attention_mask[4:6, 3:].sum() == 0
    for i, s in enumerate(states):
        assert torch.equal(packed.part(packed.state.hidden, i), s.hidden)


def _quorum_run(batched: bool) -> tuple[torch.nn.Module, dict, dict]:
    """Quorum k=2 over 4 clients: c0 and c1 forward (as one batch or alone); c2 and c3 then step the trunk
    under them; c0 and c1 send their gradients on the older weights, which makes the second step."""
    from splitfed.trunk.compute.requests import ForwardRequest
    from splitfed.trunk.compute.runtime import TrunkRuntime

    torch.manual_seed(0)
    split = split_model(tiny_model("llama").train(), cuts=(1, 3))
    rt = TrunkRuntime(split.trunk, torch.optim.SGD(split.trunk.parameters(), lr=0.1),
                      aggregator=make_aggregator("quorum", quorum=2, max_staleness=4, timeout=60))
    states = _inputs("llama", 0)
    requests = [ForwardRequest(f"c{i}", f"a{i}", states[i], True, 2 + i) for i in range(4)]
    outs, grads_in = {}, {}
    first = rt.forward_many(requests[:2]) if batched else [rt.forward_request(r) for r in requests[:2]]
    for i, (out, version) in enumerate(first):
        outs[i] = out
        assert version == 0
    pending = {}
    for i in (2, 3):  # these two make the first step, while c0 and c1 still hold their forwards
        outs[i], _ = rt.forward_request(requests[i])
        pending[i] = rt.start_backward(f"c{i}", f"a{i}", torch.sin(outs[i] * (1 + i)))
    assert rt.version == 1
    for i in (0, 1):
        pending[i] = rt.start_backward(f"c{i}", f"a{i}", torch.sin(outs[i] * (1 + i)))
    results = {i: p.result.result(30) for i, p in pending.items()}
    for i, p in pending.items():
        grads_in[i] = p.grad_in.result(30)
    assert rt.version == 2 and results[0].staleness == results[1].staleness == 1
    if batched:  # one batch of c0 and c1, rebased under the first step and recomputed for its one backward
        assert rt._batches.stats["group-backwards"] == 1 and rt.stats["recomputed"] == 1
    else:
        assert rt._batches.stats["group-backwards"] == 0 and rt.stats["recomputed"] == 2
    assert rt.store.frozen_copies == 0 and rt.store.frozen_bytes == 0  # no weight copy outlives its forwards
    return split.trunk, outs, grads_in


@pytest.mark.timeout(120)
def test_batches_rebased_step_after_step_leave_no_weight_copy_behind() -> None:
    """Six rounds in which a batch of two clients' forwards waits while two others make a quorum step: each
    round's batch is rebased and recomputed, and no frozen copy of the weights outlives it (a copy that only
    batches used was once kept with no forward counted on it: one more per such step, and past ``max_frozen``
    of them the store's eviction looped for ever under the runtime's lock)."""
    from splitfed.trunk.compute.requests import ForwardRequest
    from splitfed.trunk.compute.runtime import TrunkRuntime

    torch.manual_seed(0)
    split = split_model(tiny_model("llama").train(), cuts=(1, 3))
    rt = TrunkRuntime(split.trunk, torch.optim.SGD(split.trunk.parameters(), lr=0.1),
                      aggregator=make_aggregator("quorum", quorum=2, max_staleness=4, timeout=60))
    for r in range(6):
        states = _inputs("llama", r)
        requests = [ForwardRequest(f"c{i}", f"r{r}-a{i}", states[i], True, 2 + i) for i in range(4)]
        outs = [out for out, _ in rt.forward_many(requests[:2])]
        pending = []
        for i in (2, 3):
            out, _ = rt.forward_request(requests[i])
            pending.append(rt.start_backward(f"c{i}", f"r{r}-a{i}", torch.sin(out)))
        pending += [rt.start_backward(f"c{i}", f"r{r}-a{i}", torch.sin(outs[i])) for i in (0, 1)]
        for p in pending:
            p.result.result(30)
    assert rt.version == 12 and rt.stats["recomputed"] == 6
    assert rt.store.frozen_copies == 0 and rt.store.frozen_bytes == 0


def test_quorum_batches_the_trunk_stepped_under_equal_one_call_per_client() -> None:
    """Quorum mode batches training forwards; a batch whose backward comes after a step is recomputed on the
    weights it saw: outputs, input gradients and the weights after both steps equal one call per client."""
    trunk, outs, grads_in = _quorum_run(batched=False)
    b_trunk, b_outs, b_grads_in = _quorum_run(batched=True)
    for i in range(4):
        assert torch.allclose(outs[i], b_outs[i], atol=1e-6, rtol=1e-6), i
        assert torch.allclose(grads_in[i], b_grads_in[i], atol=1e-6, rtol=1e-6), i
    for (name, a), b in zip(trunk.state_dict().items(), b_trunk.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-6), name


def test_a_step_split_over_batches_closes_each_window_once_every_member_is_in(trunk_server, monkeypatch) -> None:
    """``max_batch_tokens`` of two clients' rows: four clients' forwards run as two batches, and neither waits
    for its (long) window: the second closes as soon as the members not in the first are in."""
    from splitfed.trunk.compute.batched import Batcher

    finished_on: list[str] = []
    finish = Batcher.finish
    monkeypatch.setattr(Batcher, "finish", lambda self, group: (finished_on.append(threading.current_thread().name),
                                                                finish(self, group))[1])
    torch.manual_seed(0)
    split = split_model(tiny_model("llama").train(), cuts=(1, 3))
    server = trunk_server(split.trunk, lr=0.1, aggregator=make_aggregator("sync", timeout=60),
                          batch_window_ms=60_000, max_batch_tokens=2 * 2 * 8)
    start = threading.Barrier(4)
    replies: dict = {}

    def client(i: int) -> None:
        c = TrunkClient(server.address, insecure=True, client_id=f"s{i}")
        c.join()
        state = CutState(torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(i)))
        start.wait(30)
        act = uuid.uuid4().hex
        out, _ = c.forward(state, activation_id=act, train=True, num_examples=2)
        replies[i] = c.backward(act, torch.ones_like(out) * 0.01)
        c.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(replies) == [0, 1, 2, 3] and {r.outcome for r in replies.values()} == {"APPLIED"}
    assert server.scheduler.stats["forward-batches"] == 2
    # The first batch closed at the token bound; the second as soon as its members were in: the 60 s window never
    # ran out.
    assert server.scheduler.stats["early-closes"] == 1
    assert server.runtime.version == 1
    # Each batch's backward ran once, on the device thread; the members' gradients joined it without it.
    assert finished_on == ["splitfed-trunk-device", "splitfed-trunk-device"]
    assert server.runtime._batches.stats["group-backwards"] == 2


def test_a_batch_is_found_among_the_open_batches_by_identity() -> None:
    """Two batches of one step, of different sizes, open at once: the second to form may complete first, and
    finding it among the open batches must not compare their tensors (which raised a size mismatch)."""
    from splitfed.trunk.compute.batching import ForwardGroup

    def group(rows: int) -> ForwardGroup:
        states = [CutState(torch.randn(1, 4, 8)) for _ in range(rows)]
        packed = pack(states)
        return ForwardGroup(packed, packed.state.hidden, packed.state.hidden * 2, 0, [f"c{i}" for i in range(rows)],
                            [f"a{i}" for i in range(rows)], [1] * rows)

    first, second = group(5), group(3)
    open_batches = [first, second]
    assert second in open_batches and open_batches.index(second) == 1
    open_batches.remove(second)
    assert open_batches == [first] and second not in open_batches


def test_a_window_closes_when_its_last_member_comes_or_the_batch_is_full_not_at_its_end(trunk_server) -> None:
    """Forwards 0.5 s apart into a 60 s window, at most two clients' rows a batch: the first batch runs as soon as
    a third forward could not fit (before the fourth is sent), the second as soon as the last member is in. The
    device thread sleeps between arrivals that cannot close the window, so this is what wakes it."""
    import time

    split = split_model(tiny_model("llama").train(), cuts=(1, 3))
    server = trunk_server(split.trunk, lr=0.1, aggregator=make_aggregator("sync", timeout=60),
                          batch_window_ms=60_000, max_batch_tokens=2 * 2 * 8)
    start = threading.Barrier(4)
    sent: dict[int, float] = {}
    answered: dict[int, float] = {}

    def client(i: int) -> None:
        c = TrunkClient(server.address, insecure=True, client_id=f"w{i}")
        c.join()
        state = CutState(torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(i)))
        start.wait(30)
        time.sleep(0.5 * i)
        act = uuid.uuid4().hex
        sent[i] = time.perf_counter()
        out, _ = c.forward(state, activation_id=act, train=True, num_examples=2)
        answered[i] = time.perf_counter()
        c.backward(act, torch.ones_like(out) * 0.01)
        c.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert sorted(answered) == [0, 1, 2, 3], "a window waited for its end (60 s) instead of closing"
    assert server.scheduler.stats["forward-batches"] == 2 and server.runtime.version == 1
    assert answered[0] < sent[3] and answered[1] < sent[3], "the first batch waited past the arrival that filled it"
    assert answered[3] - sent[3] < 10


def test_a_batched_backward_that_fails_unexpectedly_answers_every_waiting_member(trunk_server, monkeypatch) -> None:
    """An error the batched backward does not expect (not a RuntimeError of autograd) still reaches every member
    waiting for its gradient, as INTERNAL naming the batch, instead of leaving them waiting until their deadline."""
    from splitfed.channel.wire.retry import RetryPolicy
    from splitfed.errors import ChannelError
    from splitfed.trunk.compute.batched import Batcher

    def broken_output(self, group):  # type: ignore[no-untyped-def]
        raise ValueError("an unexpected failure")

    monkeypatch.setattr(Batcher, "_output", broken_output)
    split = split_model(tiny_model("llama").train(), cuts=(1, 3))
    server = trunk_server(split.trunk, lr=0.1, aggregator=make_aggregator("sync", timeout=60),
                          batch_window_ms=60_000)
    start = threading.Barrier(4)
    errors: dict = {}

    def client(i: int) -> None:
        with TrunkClient(server.address, insecure=True, client_id=f"f{i}", retry=RetryPolicy(timeout_s=15)) as c:
            c.join()
            state = CutState(torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(i)))
            start.wait(30)
            act = uuid.uuid4().hex
            out, _ = c.forward(state, activation_id=act, train=True, num_examples=2)
            try:
                c.backward(act, torch.ones_like(out))
            except ChannelError as exc:
                errors[i] = exc

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(errors) == [0, 1, 2, 3], errors
    for exc in errors.values():
        assert exc.code == "INTERNAL" and "the batched backward of 4 clients failed" in str(exc), exc
        assert "an unexpected failure" in str(exc)
    assert server.scheduler.stats["forward-batches"] == 1
