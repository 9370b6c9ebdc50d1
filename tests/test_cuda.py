"""The CUDA paths: parts on a GPU, activations to and from host memory over the channel, bf16 autocast,
generation with a GPU trunk. Skipped without a GPU (run on a GPU machine: ``python -m pytest tests/test_cuda.py``)."""

from __future__ import annotations

import contextlib
import copy
import multiprocessing as mp
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from conftest import batch_for, tiny_model

from splitfed.channel.client.remote import RemoteTrunk
from splitfed.channel.client.trunk import TrunkClient
from splitfed.split import SplitModel, split_model
from splitfed.trunk.compute.runtime import TrunkRuntime

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def _deterministic():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield


def _five_steps_side_by_side(client, opt, model, ref, ref_opt, batch, steps: int = 5,  # type: ignore[no-untyped-def]
                             before: Callable[[int], None] | None = None) -> float:
    """5 (``steps``) steps of the split model and of the unsplit reference on one batch (``before(step)`` first);
    the largest weight difference."""
    ids, mask, labels = batch
    for step in range(steps):
        if before is not None:
            before(step)
        client(ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
        ref(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return max((a - b.to(a.device)).abs().max().item()
               for a, b in zip(model.state_dict().values(), ref.state_dict().values()))


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2", "gemma"])
def test_split_forward_on_gpu_equals_unsplit(arch: str) -> None:
    model = tiny_model(arch).to(CUDA)
    ref = copy.deepcopy(model)
    ids, mask, _ = batch_for(arch, padded=True)
    ids, mask = ids.to(CUDA), mask.to(CUDA)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).logits
        got = split_model(model, (1, 3))(ids, attention_mask=mask).logits
    assert (want - got)[mask.bool()].abs().max().item() <= 1e-5


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_five_gpu_steps_over_grpc_equal_unsplit(arch: str, trunk_server) -> None:
    model = tiny_model(arch).train().to(CUDA)
    ref = copy.deepcopy(model)
    split = split_model(model, (1, 3))
    server = trunk_server(TrunkRuntime(split.trunk, torch.optim.AdamW(split.trunk.parameters(), lr=1e-2)))
    client = SplitModel(split.bottom, RemoteTrunk(server.address, insecure=True), split.top, task="causal-lm")
    opt = torch.optim.AdamW(split.client_modules().parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ids, mask, labels = (t.to(CUDA) for t in batch_for(arch, padded=True))
    diff = _five_steps_side_by_side(client, opt, model, ref, ref_opt, (ids, mask, labels))
    assert diff <= 1e-5
    assert next(split.trunk.parameters()).is_cuda


def _train_bf16(trunk_server, micro_batches: int = 1, channels: int = 1, batch: int = 4):  # type: ignore[no-untyped-def]
    """8 AdamW steps of a tiny Llama split over the channel, bf16 autocast on both sides and bf16 on the wire."""
    model = tiny_model("llama").train().to(CUDA)
    split = split_model(model, (1, 3))
    server = trunk_server(TrunkRuntime(split.trunk, torch.optim.AdamW(split.trunk.parameters(), lr=1e-2),
                                       autocast_dtype=torch.bfloat16))
    remote = RemoteTrunk(server.address, insecure=True, wire_dtype="bf16", channels=channels)
    client = SplitModel(split.bottom, remote, split.top, task="causal-lm", micro_batches=micro_batches)
    opt = torch.optim.AdamW(split.client_modules().parameters(), lr=1e-2)
    ids, mask, labels = (t.to(CUDA) for t in batch_for("llama", batch=batch, length=16))
    losses = []
    for _ in range(8):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = client(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, server, losses


def test_bf16_autocast_on_gpu_trains(trunk_server) -> None:
    model, _, losses = _train_bf16(trunk_server)
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_greedy_generation_with_a_gpu_trunk_equals_unsplit(trunk_server) -> None:
    from splitfed.client.generation import RemoteSession, generate

    model = tiny_model("llama").to(CUDA)
    ref = copy.deepcopy(model)
    split = split_model(model, (1, 3))
    server = trunk_server(split.trunk)
    ids = torch.randint(3, 90, (1, 6), device=CUDA)
    want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                        pad_token_id=0)
    with RemoteSession(TrunkClient(server.address, insecure=True), max_length=18) as session:
        got = generate(split.bottom, session, split.top, ids, max_new_tokens=12)
    assert torch.equal(got[:, -12:].cpu(), want[:, -12:].cpu())


# -- the pipelined split step and its transfers (splitfed.codec.transfer, splitfed.channel.client.pipeline) ----------------
def test_staging_copies_on_a_side_stream_from_reused_pinned_buffers() -> None:
    from splitfed.codec.transfer import Staging

    staging = Staging(CUDA)
    x = torch.randn(64, 128, device=CUDA)
    y = x * 2  # queued on the compute stream; the side-stream copy must wait for it
    first = staging.to_host(y)
    host = first.wait()
    assert host.is_pinned() and host.device.type == "cpu"
    assert torch.equal(host, (x * 2).cpu())
    ptr = host.data_ptr()
    first.release()
    second = staging.to_host(y + 1)
    assert second.wait().data_ptr() == ptr  # the same pinned buffer, reused
    assert torch.equal(second.tensor, (y + 1).cpu())
    second.release()
    back = staging.to_device(torch.arange(12.0).reshape(3, 4), torch.float32)
    assert back.is_cuda and torch.equal(back.cpu(), torch.arange(12.0).reshape(3, 4))
    cast = staging.to_host(x, torch.bfloat16)  # cast on the device: half the bytes cross
    assert cast.wait().dtype == torch.bfloat16 and torch.equal(cast.tensor, x.to(torch.bfloat16).cpu())
    cast.release()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_pipelined_gpu_steps_over_grpc_equal_unsplit(arch: str, trunk_server) -> None:
    # The trunk is served from this process on the same GPU: the pipeline's backward must never block the
    # GPU's autograd worker, which the trunk's own backward needs.
    from splitfed.codec import transfer

    model = tiny_model(arch).train().to(CUDA)
    ref = copy.deepcopy(model)
    split = split_model(model, (1, 3))
    server = trunk_server(TrunkRuntime(split.trunk, torch.optim.SGD(split.trunk.parameters(), lr=0.05)))
    remote = RemoteTrunk(server.address, insecure=True, channels=2)
    client = SplitModel(split.bottom, remote, split.top, task="causal-lm", micro_batches=4)
    opt = torch.optim.SGD(split.client_modules().parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    ids, mask, labels = (t.to(CUDA) for t in batch_for(arch, batch=5, padded=True))
    before = dict(transfer.COPIES)
    diff = _five_steps_side_by_side(client, opt, model, ref, ref_opt, (ids, mask, labels))
    assert diff <= 1e-5
    assert server.runtime.version == 5 and remote.outcomes == {"APPLIED": 5}
    # Activations and masks leave through the side stream (default positions stay on the client); activations
    # and gradients come back so (on the client), and the trunk in this process takes them in likewise.
    assert transfer.COPIES["d2h"] - before["d2h"] == 5 * 4 * (2 + 1)
    assert transfer.COPIES["h2d"] - before["h2d"] == 5 * 4 * 2 + 5 * 4 * 2
    assert any(s.pooled > 0 for s in remote.__dict__["_stagings"].values())  # pinned buffers kept for reuse
    assert server.runtime._staging is not None  # the trunk takes its inputs through pinned buffers too
    remote.close()


def test_pipelined_bf16_autocast_on_gpu_trains(trunk_server) -> None:
    _, server, losses = _train_bf16(trunk_server, micro_batches=4, channels=2, batch=8)
    assert losses[-1] < losses[0]
    assert server.runtime.version == 8


def _serve_llama_trunk(port_queue, stop, device: str = "cuda",  # type: ignore[no-untyped-def]
                       idle_s: float | None = None) -> None:
    """A tiny Llama's trunk on a GPU, served from its own process (IPC events order the region's copies)."""
    from splitfed.channel.server.trunkserver import TrunkServer

    split = split_model(tiny_model("llama").train().to(device), (1, 3))
    server = TrunkServer(TrunkRuntime(split.trunk, torch.optim.AdamW(split.trunk.parameters(), lr=1e-2)),
                         insecure=True).start()
    if idle_s is not None:
        server.servicer.regions.idle_s = idle_s
    port_queue.put(server.port)
    stop.wait()
    server.stop(grace=0)


@contextlib.contextmanager
def _llama_trunk(where: str, trunk_server, split, device: str = "cuda",  # type: ignore[no-untyped-def]
                 idle_s: float | None = None) -> Iterator[str]:
    """The address of a trunk server: ``split``'s trunk in a thread of this process, or (``process``) a tiny Llama's
    trunk with the same weights in a process of its own (IPC events and memory)."""
    if where == "thread":
        trunk = split.trunk.to(device)
        yield trunk_server(TrunkRuntime(trunk, torch.optim.AdamW(trunk.parameters(), lr=1e-2))).address
        return
    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_serve_llama_trunk, args=(ports, stop, device, idle_s), daemon=True)
    proc.start()
    try:
        yield f"127.0.0.1:{ports.get(timeout=120)}"
    finally:
        stop.set()
        proc.join(30)


def _client_parts_diff(model: torch.nn.Module, ref: torch.nn.Module, trunk_ids: set[int]) -> float:
    """The largest difference of the client's parameters (the trunk's may live in another process) from ``ref``."""
    ref_params = dict(ref.named_parameters())
    return max((p - ref_params[n].to(p.device)).abs().max().item() for n, p in model.named_parameters()
               if id(p) not in trunk_ids)


def _five_remote_steps(address: str, split, model, ref, device: torch.device,  # type: ignore[no-untyped-def]
                       **steps: Any) -> RemoteTrunk:
    """5 AdamW steps of ``split`` over the trunk at ``address`` beside ``ref``'s (``steps``: as for
    :func:`_five_steps_side_by_side`); returns the open remote trunk."""
    remote = RemoteTrunk(address, insecure=True)
    client = SplitModel(split.bottom, remote, split.top, task="causal-lm")
    opt = torch.optim.AdamW(split.client_modules().parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    batch = tuple(t.to(device) for t in batch_for("llama", padded=True))
    _five_steps_side_by_side(client, opt, model, ref, ref_opt, batch, **steps)
    return remote


@pytest.mark.parametrize("where", ["thread", "process"])
def test_five_gpu_steps_through_gpu_ordered_shared_memory_equal_unsplit(where: str, trunk_server,
                                                                        monkeypatch) -> None:
    from splitfed.channel.transports.shm import lane as shared

    monkeypatch.setattr(shared, "MIN_REGION_TENSOR_BYTES", 1)  # the tiny model's activations are small
    model = tiny_model("llama").train().to(CUDA)
    ref = copy.deepcopy(model)
    split = split_model(model, (1, 3))
    trunk_ids = {id(p) for p in split.trunk.parameters()}
    with _llama_trunk(where, trunk_server, split) as address:
        remote = _five_remote_steps(address, split, model, ref, CUDA)
        shared_lane = remote.client.shared
        assert shared_lane.calls == shared_lane.ordered == 10  # ordered on the GPU, not the host
        assert shared_lane.on_gpu == 10  # through the region's GPU memory: copies device to device
        assert _client_parts_diff(model, ref, trunk_ids) <= 1e-5  # in a process of its own, the trunk is there
        remote.close()


def test_nan_through_gpu_ordered_shared_memory_is_refused_at_the_backward(trunk_server, monkeypatch) -> None:
    from splitfed.channel.transports.shm import lane as shared
    from splitfed.errors import ChannelError
    from splitfed.split import CutState

    from splitfed.split.sequential import split_sequential

    monkeypatch.setattr(shared, "MIN_REGION_TENSOR_BYTES", 1)
    _, trunk, _ = split_sequential(torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(3))), 1, 2)
    trunk = trunk.to(CUDA)
    before = copy.deepcopy(trunk.state_dict())
    server = trunk_server(trunk, lr=0.1)
    with TrunkClient(server.address, insecure=True) as client:
        x = torch.randn(4, 16, device=CUDA)
        x[1, 3] = float("nan")
        out, _ = client.forward(CutState(x), activation_id="a", on_device=True)  # not checked on the host here
        assert out.is_cuda and client.shared.region.events is not None
        with pytest.raises(ChannelError, match="NaN or Inf") as info:
            client.backward("a", torch.ones_like(out), on_device=True)
        assert info.value.code == "INVALID_ARGUMENT"
        with pytest.raises(ChannelError, match="NaN or Inf"):  # no Backward will come: checked at once
            client.forward(CutState(x), train=False, on_device=True)
    assert all(torch.equal(before[k], v) for k, v in server.runtime.trunk.state_dict().items())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("where", ["thread", "process"])
def test_a_client_on_another_gpu_than_the_trunk_copies_through_the_host_and_trains_exactly(
        where: str, trunk_server, monkeypatch) -> None:
    # The region's CUDA events belong to the trunk's GPU; a client computing on another GPU cannot wait on them, so
    # its copies are ordered by the host (the region still carries the bytes).
    from splitfed.channel.transports.shm import lane as shared

    monkeypatch.setattr(shared, "MIN_REGION_TENSOR_BYTES", 1)
    client_gpu = torch.device("cuda:1")
    model = tiny_model("llama").train().to(client_gpu)
    ref = copy.deepcopy(model)
    split = split_model(model, (1, 3))
    trunk_ids = {id(p) for p in split.trunk.parameters()}
    with _llama_trunk(where, trunk_server, split, device="cuda:0") as address:
        remote = _five_remote_steps(address, split, model, ref, client_gpu)
        assert remote.client.shared.calls == 10 and remote.client.shared.ordered == remote.client.shared.on_gpu == 0
        assert remote.client.shared.region.mapping.pin_error is None  # pinned for the client's GPU too
        assert _client_parts_diff(model, ref, trunk_ids) <= 1e-5
        if where == "thread":
            ref_trunk = {n: p for n, p in ref.named_parameters() if n.startswith("model.layers.")}
            got = {split.trunk.spec.full_key(n): p for n, p in split.trunk.named_parameters()}
            assert max((got[n] - ref_trunk[n].to(got[n].device)).abs().max().item() for n in got) <= 1e-5
        remote.close()


def test_gpu_memory_slices_are_checked_like_the_file(trunk_server) -> None:
    # A region whose copies CUDA events order has a twin in the trunk's GPU memory; a slice naming it is checked
    # against its bounds and must come with an event, and a bad one changes nothing on the server.
    import os

    import grpc

    from splitfed.channel.wire import split_channel_pb2 as pb
    from splitfed.channel.wire import split_channel_pb2_grpc as pb_grpc
    from splitfed.channel.server.trunkserver import CLIENT_ID_KEY
    from splitfed.split.sequential import split_sequential

    _, trunk, _ = split_sequential(torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(3))), 1, 2)
    server = trunk_server(trunk.to(CUDA), lr=0.1)
    before = copy.deepcopy(server.runtime.trunk.state_dict())
    md = [(CLIENT_ID_KEY, "alice")]
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.SplitChannelStub(channel)
        anonymous = stub.OpenRegion(pb.OpenRegionRequest(nbytes=1 << 20, cuda_events=True), metadata=md, timeout=20)
        assert anonymous.event_handles and not anonymous.device_memory  # no process to outlive: no GPU memory
        region = stub.OpenRegion(pb.OpenRegionRequest(nbytes=1 << 20, cuda_events=True, client_pid=os.getpid()),
                                 metadata=md, timeout=20)
        assert len(region.device_memory) == 64 and region.event_handles

        def forward(**slice_fields: object) -> None:
            ref = pb.RegionSlice(region=region.region, offset=0, nbytes=4 * 16 * 4, event=1, device=True)
            for key, value in slice_fields.items():
                setattr(ref, key, value)
            tensor = pb.Tensor(name="hidden", dtype=pb.FLOAT32, shape=[4, 16], region=ref)
            stub.Forward(pb.ForwardRequest(activation_id="a", train=True, num_examples=4, tensors=[tensor]),
                         metadata=md, timeout=20)

        for fields, message in (({"offset": region.nbytes - 64}, "outside the region's GPU memory"),
                                ({"event": 0}, "without an event")):
            with pytest.raises(grpc.RpcError) as info:
                forward(**fields)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in info.value.details()
    assert all(torch.equal(before[k], v) for k, v in server.runtime.trunk.state_dict().items())


def test_a_region_closed_while_idle_keeps_its_gpu_memory_for_its_live_client(trunk_server, monkeypatch) -> None:
    # The server closes a region nobody used for idle_s when another is opened; its client (a live process) still
    # maps the region's GPU memory and writes its next call there before it learns the region is gone. That memory
    # must still be the client's (freeing it would be undefined behaviour in CUDA): training goes on exactly.
    import time

    from splitfed.channel.transports.shm import lane as shared

    monkeypatch.setattr(shared, "MIN_REGION_TENSOR_BYTES", 1)
    model = tiny_model("llama").train().to(CUDA)
    ref = copy.deepcopy(model)
    split = split_model(model, (1, 3))
    trunk_ids = {id(p) for p in split.trunk.parameters()}
    with _llama_trunk("process", trunk_server, split, idle_s=0.5) as address:
        def sweep(step: int) -> None:
            if step == 2:  # idle past idle_s, then another client's region sweeps this one away
                time.sleep(1.0)
                with TrunkClient(address, insecure=True, client_id="other") as other:
                    assert other.shared._region(cuda=True, need=4096) is not None

        remote = _five_remote_steps(address, split, model, ref, CUDA, steps=4, before=sweep)
        assert remote.client.shared.on_gpu >= 6  # the region came back after the sweep
        assert _client_parts_diff(model, ref, trunk_ids) <= 1e-5
        remote.close()


def test_gpu_blocks_kept_for_a_client_count_against_its_share() -> None:
    import os
    import subprocess
    import sys

    from splitfed.channel.transports.shm import devmem
    from splitfed.channel.transports.shm.regions import RegionTable

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    table = RegionTable(max_client_bytes=4 << 20, max_total_bytes=64 << 20, pin=True)
    try:
        kept = devmem.DeviceMemory.allocate(3 << 20, 0)
        devmem.retire("splitfed-kept", kept, "carol", sleeper.pid, devmem.process_start(sleeper.pid))
        carol = table.open("carol", 2 << 20, events_on=0, client_pid=os.getpid())
        dave = table.open("dave", 2 << 20, events_on=0, client_pid=os.getpid())
        assert carol.events is not None and carol.device_memory is None  # 3 MiB kept + 2 MiB would pass 4 MiB
        assert dave.device_memory is not None and dave.device_memory.nbytes == dave.nbytes
    finally:
        table.close_all()
        sleeper.kill()
        sleeper.wait()
    devmem.sweep()
    assert devmem.parked_bytes("carol") == 0


@pytest.mark.parametrize("streamed", [False, True])
def test_over_the_socket_a_gpu_client_sends_and_receives_through_pinned_memory(trunk_server, streamed: bool) -> None:
    """Without shared memory, a GPU tensor is encoded from pinned host memory (not pageable: several times slower)
    and an owned reply for a caller on the GPU lands in pinned memory (its copy to the GPU then does not wait)."""
    from splitfed.channel.wire.limits import ChannelLimits
    from splitfed.codec.tensors import decode, encode
    from splitfed.split import CutState

    x = torch.randn(4, 9, 32, device=CUDA)
    wire = encode("x", x, "bf16")
    assert torch.equal(decode(wire), x.to(torch.bfloat16).cpu())
    split = split_model(tiny_model("gpt2").train(), (1, 3))
    limits = ChannelLimits(stream_threshold_bytes=1024, chunk_bytes=512) if streamed else ChannelLimits()
    server = trunk_server(split.trunk, optimizer="sgd", lr=1e-9, limits=limits)
    client = TrunkClient(server.address, insecure=True, limits=limits, shared_memory="off")
    out, _ = client.forward(CutState(x), activation_id="a", owned=True)
    with torch.no_grad():
        expected = split.trunk(CutState(x.cpu())).hidden
    assert out.is_pinned() and torch.allclose(out, expected, atol=1e-5)
    grad = torch.empty(out.shape, pin_memory=True).fill_(1.0)  # as the GPU client's autograd sends it
    reply = client.backward("a", grad, input_numel=x.numel(), owned=True)
    assert reply.grad.is_pinned() and reply.grad.shape == x.shape
    client.close()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_split_step_through_gpu_ordered_shared_memory_reads_the_gpu_only_for_the_gradient_guard(
        arch: str, trunk_server, monkeypatch) -> None:
    # Default positions cost no read in any part (they stay on the client), and the region's NaN/Inf verdicts wait
    # for their checks alone; the one read left is the gradient guard's norm, needed before the step applies.
    from bench.host_syncs import where_host_syncs
    from splitfed.channel.transports.shm import lane as shared

    monkeypatch.setattr(shared, "MIN_REGION_TENSOR_BYTES", 1)
    split = split_model(tiny_model(arch).train().to(CUDA), (1, 3))
    server = trunk_server(TrunkRuntime(split.trunk, torch.optim.SGD(split.trunk.parameters(), lr=0.05)))
    remote = RemoteTrunk(server.address, insecure=True)
    client = SplitModel(split.bottom, remote, split.top, task="causal-lm")
    opt = torch.optim.SGD(split.client_modules().parameters(), lr=0.05)
    ids, _, _ = (t.to(CUDA) for t in batch_for(arch))

    def step() -> None:
        client(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()

    for _ in range(2):  # the region opens and the pipeline warms up
        step()
    reads = where_host_syncs(step)
    assert remote.client.shared.on_gpu == remote.client.shared.calls > 0  # event-ordered, device to device
    assert sum(reads.values()) == 1, "\n".join(reads)
    assert "guard.py" in next(iter(reads))
