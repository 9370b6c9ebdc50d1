"""Large tensors of a request stay in host memory until the device thread brings them, a batch at a time: copied
into memory of the server's own and checked for NaN/Inf there (on a GPU, by the copy engine and one fused check;
``tests/test_gpu_server.py``). Training through them equals one call per client; a client whose tensor holds NaN
is refused and the others train; a region stays mapped while a copy reads it."""

from __future__ import annotations

import copy
import threading
import time
import uuid

import pytest
import torch
from conftest import tiny_model

from splitfed.channel.transports.shm import serverio as regionio
from splitfed.channel.transports.shm import lane as shared
from splitfed.channel.client.trunk import TrunkClient
from splitfed.channel.transports.shm.regions import SharedRegion
from splitfed.errors import ChannelError
from splitfed.split import CutState, split_model
from splitfed.trunk.aggregation.modes import make_aggregator

LENGTHS = (5, 9, 3, 7)
EXAMPLES = (2, 3, 4, 5)


@pytest.fixture
def arrivals(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every floating tensor of a request takes the path large ones take (the tests' tensors are tiny)."""
    monkeypatch.setattr(regionio, "ARRIVAL_MIN_BYTES", 1)
    monkeypatch.setattr(shared, "MIN_REGION_TENSOR_BYTES", 1)


def _state(i: int) -> CutState:
    return CutState(torch.randn(2, LENGTHS[i], 32, generator=torch.Generator().manual_seed(100 + i)))


def _trunk():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return split_model(tiny_model("llama").train(), cuts=(1, 3)).trunk


def _step(trunk_server, transport: str, window_ms: float, nan_forward: int | None = None,
          nan_grad: int | None = None):  # type: ignore[no-untyped-def]
    trunk = _trunk()
    server = trunk_server(trunk, lr=0.1, aggregator=make_aggregator("sync", timeout=60), batch_window_ms=window_ms)
    outs: dict = {}
    errors: dict = {}
    start = threading.Barrier(len(LENGTHS))

    def client(i: int) -> None:
        c = TrunkClient(server.address, insecure=True, client_id=f"c{i}", shared_memory=transport)
        c.join()
        state = _state(i)
        if nan_forward == i:
            state = CutState(state.hidden.clone().index_fill_(1, torch.tensor([0]), float("nan")))
        start.wait(30)
        act = uuid.uuid4().hex
        try:
            out, _ = c.forward(state, activation_id=act, train=True, num_examples=EXAMPLES[i])
            grad = torch.sin(out * (1 + i))
            if nan_grad == i:
                grad[0, 0, 0] = float("inf")
            reply = c.backward(act, grad)
            outs[i] = (out, reply.grad, reply.outcome)
        except ChannelError as exc:
            errors[i] = exc
        c.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(LENGTHS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return trunk, server, outs, errors


@pytest.mark.parametrize("transport", ["on", "off"])
def test_tensors_brought_by_the_device_thread_train_as_one_call_per_client(trunk_server, arrivals,
                                                                           transport: str) -> None:
    trunk, server, outs, errors = _step(trunk_server, transport, window_ms=5000)
    assert not errors and sorted(outs) == [0, 1, 2, 3]
    assert server.runtime.io.stats["brought"] == 2 * len(LENGTHS)  # every activation and gradient
    assert server.runtime._batches.stats["group-backwards"] == 1
    ref_trunk, _, ref_outs, _ = _step(trunk_server, "off", window_ms=0)  # one call per client
    for i, (out, grad_in, outcome) in ref_outs.items():
        assert outcome == outs[i][2] == "APPLIED"
        assert torch.allclose(out, outs[i][0], atol=1e-6, rtol=1e-6)
        assert torch.allclose(grad_in, outs[i][1], atol=1e-6, rtol=1e-6)
    for (name, a), b in zip(ref_trunk.state_dict().items(), trunk.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-6), name


@pytest.mark.parametrize("transport", ["on", "off"])
def test_a_nan_activation_is_refused_before_its_batch_runs_and_the_others_train(trunk_server, arrivals,
                                                                                transport: str) -> None:
    trunk, server, outs, errors = _step(trunk_server, transport, window_ms=5000, nan_forward=2)
    assert list(errors) == [2] and errors[2].code == "INVALID_ARGUMENT" and "NaN or Inf" in str(errors[2])
    assert sorted(outs) == [0, 1, 3] and {o for _, _, o in outs.values()} == {"APPLIED"}
    assert server.runtime.version == 1


@pytest.mark.parametrize("transport", ["on", "off"])
def test_a_nan_gradient_is_refused_at_its_batchs_backward_and_the_others_step_exactly(trunk_server, arrivals,
                                                                                      transport: str) -> None:
    before = copy.deepcopy(_trunk())
    trunk, server, outs, errors = _step(trunk_server, transport, window_ms=5000, nan_grad=1)
    assert list(errors) == [1] and errors[1].code == "INVALID_ARGUMENT" and "NaN or Inf" in str(errors[1])
    assert sorted(outs) == [0, 2, 3] and {o for _, _, o in outs.values()} == {"APPLIED"}
    assert server.runtime.version == 1
    # The step is the example-weighted gradient of the three others, as if client 1 had sent none.
    opt = torch.optim.SGD(before.parameters(), lr=0.1)
    total = sum(EXAMPLES[i] for i in outs)
    for i in outs:
        out = before(_state(i)).hidden
        out.backward(torch.sin(out.detach() * (1 + i)) * EXAMPLES[i] / total)
    opt.step()
    for (name, a), b in zip(before.state_dict().items(), trunk.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-6), name


def test_a_region_stays_mapped_while_a_copy_reads_it() -> None:
    region = SharedRegion.create(1 << 16)
    closed = threading.Event()
    with region.reading():
        closer = threading.Thread(target=lambda: (region.close(), closed.set()))
        closer.start()
        time.sleep(0.3)
        assert not closed.is_set()  # close() waits for the copy
        assert region.bytes.numel() == 1 << 16
    closer.join(10)
    assert closed.is_set() and region.bytes.numel() == 0
