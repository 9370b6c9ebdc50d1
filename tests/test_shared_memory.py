"""Tensors through a shared-memory region when client and trunk share a host: bound to their client, checked,
copied before use, and the socket takes over whenever the region cannot serve.

Exactness of training through regions (every architecture, SGD and AdamW) is in test_train_equivalence.py; the
bad requests naming regions are in test_channel.py's catalogue.
"""

from __future__ import annotations

import copy
import os
import stat

import pytest
import torch
from torch import nn

from splitfed.channel.transports.shm import lane as shared
from splitfed.channel.client.trunk import TrunkClient
from splitfed.channel.wire.limits import ChannelLimits
from splitfed.channel.transports.shm.regions import RegionTable, SharedRegion
from splitfed.codec.tensors import RegionRef
from splitfed.errors import (
    ChannelError,
    CodecError,
    PermissionDeniedError,
    RegionNotFoundError,
    ResourceExhaustedError,
    SharedMemoryUnavailableError,
)
from splitfed.split import CutState
from splitfed.split.sequential import split_sequential

MiB = 1 << 20


@pytest.fixture(autouse=True)
def small_tensors_too(monkeypatch) -> None:
    monkeypatch.setattr(shared, "MIN_REGION_TENSOR_BYTES", 1)


def _mlp(width_out: int = 16) -> tuple[nn.Module, nn.Module, nn.Module]:
    torch.manual_seed(0)
    return split_sequential(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, width_out), nn.Linear(width_out, 4)), 1, 2)


def test_region_table_binds_regions_to_their_client_and_bounds_them() -> None:
    table = RegionTable(max_client_bytes=2 * MiB, max_total_bytes=3 * MiB, idle_s=60)
    a = table.open("alice", MiB)
    mode = stat.S_IMODE(os.stat(a.path).st_mode)
    assert mode == 0o600  # only the server's user may map it
    assert table.slice("alice", RegionRef(a.name, 0, 64)).numel() == 64
    assert not a.path.exists()  # used by its client, so mapped there: the name goes, the memory stays
    assert table.slice("alice", RegionRef(a.name, 0, 64)).numel() == 64
    with pytest.raises(PermissionDeniedError):
        table.slice("bob", RegionRef(a.name, 0, 64))
    with pytest.raises(CodecError, match="outside region"):
        table.slice("alice", RegionRef(a.name, MiB - 8, 64))
    with pytest.raises(RegionNotFoundError):
        table.slice("alice", RegionRef("splitfed-" + "0" * 32, 0, 1))
    b = table.open("alice", MiB)
    c = table.open("alice", MiB)  # over alice's 2 MiB: her oldest region is closed
    assert not a.path.exists() and b.path.exists() and c.path.exists()
    with pytest.raises(RegionNotFoundError):
        table.slice("alice", RegionRef(a.name, 0, 1))
    table.open("bob", MiB)
    with pytest.raises(ResourceExhaustedError, match="limit"):
        table.open("carol", MiB)  # 3 MiB held in all
    table.close("alice", b.name)
    table.close("alice", b.name)  # closing twice is a no-op
    assert not b.path.exists()
    big = table.open("alice", 64 * MiB)  # capped to alice's 2 MiB, closing her older region
    assert big.nbytes == 2 * MiB and not c.path.exists()
    table.close_all()
    assert table.total_bytes == 0 and not c.path.exists()


def test_idle_regions_are_closed_when_another_is_opened() -> None:
    table = RegionTable(idle_s=0.0)
    gone = table.open("alice", MiB)
    table.open("bob", MiB)
    assert not gone.path.exists()
    table.close_all()


def test_a_client_maps_only_splitfed_regions() -> None:
    with pytest.raises(SharedMemoryUnavailableError, match="not a splitfed region"):
        SharedRegion.attach("../../etc/passwd", 10)
    with pytest.raises(SharedMemoryUnavailableError, match="another host"):
        SharedRegion.attach("splitfed-" + "0" * 32, 10)


def test_auto_uses_shared_memory_on_loopback_only() -> None:
    assert TrunkClient("127.0.0.1:1", insecure=True).shared.mode == "on"
    assert TrunkClient("[::1]:1", insecure=True).shared.mode == "on"
    assert TrunkClient("10.1.2.3:1", insecure=True).shared.mode == "off"
    assert TrunkClient("10.1.2.3:1", insecure=True, shared_memory="on").shared.mode == "on"
    assert TrunkClient("127.0.0.1:1", insecure=True, shared_memory="off").shared.mode == "off"


def _forward_backward(client: TrunkClient, x: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    out, _ = client.forward(CutState(x), activation_id=act)
    return out, client.backward(act, torch.ones_like(out)).grad


def test_tensors_go_through_the_region_and_equal_the_socket(trunk_server) -> None:
    _, trunk, _ = _mlp()
    server, other = trunk_server(copy.deepcopy(trunk)), trunk_server(copy.deepcopy(trunk))
    x = torch.randn(5, 16)
    with TrunkClient(server.address, insecure=True, shared_memory="on") as a, \
            TrunkClient(other.address, insecure=True, shared_memory="off") as b:
        out_a, grad_a = _forward_backward(a, x, "a")
        out_b, grad_b = _forward_backward(b, x, "b")
        assert a.shared.calls == 2 and b.shared.calls == 0
        assert a.bytes_sent == b.bytes_sent and a.bytes_received == b.bytes_received  # payload, either way
    assert torch.equal(out_a, out_b) and torch.equal(grad_a, grad_b)
    for p, q in zip(server.runtime.trunk.parameters(), other.runtime.trunk.parameters()):
        assert torch.equal(p, q)
    assert server.servicer.regions.total_bytes == 0  # closed with the client


def test_no_shared_memory_on_the_server_means_the_socket(trunk_server) -> None:
    _, trunk, _ = _mlp()
    server = trunk_server(trunk, shared_memory_bytes=0)
    with TrunkClient(server.address, insecure=True, shared_memory="on") as client:
        _forward_backward(client, torch.randn(5, 16), "a")
        assert client.shared.mode == "off" and client.shared.calls == 0


def test_a_client_on_another_host_falls_back_and_the_server_closes_its_region(trunk_server, monkeypatch) -> None:
    _, trunk, _ = _mlp()
    server = trunk_server(trunk)

    def elsewhere(name: str, nbytes: int) -> SharedRegion:
        raise SharedMemoryUnavailableError("cannot open region: the trunk server runs on another host")

    monkeypatch.setattr(shared.SharedRegion, "attach", staticmethod(elsewhere))
    with TrunkClient(server.address, insecure=True, shared_memory="on") as client:
        _forward_backward(client, torch.randn(5, 16), "a")
        assert client.shared.mode == "off" and client.shared.calls == 0
        assert server.servicer.regions.total_bytes == 0


def test_a_failed_call_retires_its_region(trunk_server) -> None:
    _, trunk, _ = _mlp()
    server = trunk_server(trunk)
    with TrunkClient(server.address, insecure=True, shared_memory="on") as client:
        client.forward(CutState(torch.randn(5, 16)), activation_id="a")
        first = client.shared.region
        with pytest.raises(ChannelError) as info:  # a reply may still land in its slices: never reuse them
            client.backward("never-forwarded", torch.ones(5, 16))
        assert info.value.code == "NOT_FOUND"
        assert first.broken
        _forward_backward(client, torch.randn(5, 16), "b")
        assert client.shared.region is not first and client.shared.region.name != first.name
        assert client.shared.calls == 3


def test_a_region_closed_on_the_server_is_replaced_without_failing_the_call(trunk_server) -> None:
    _, trunk, _ = _mlp()
    server = trunk_server(trunk)
    with TrunkClient(server.address, insecure=True, shared_memory="on") as client:
        _forward_backward(client, torch.randn(5, 16), "a")
        first = client.shared.region.name
        server.servicer.regions.close_all()  # as after a restart, or an idle sweep
        _forward_backward(client, torch.randn(5, 16), "b")  # this Forward went over the socket
        _forward_backward(client, torch.randn(5, 16), "c")  # and then through a new region again
        assert client.shared.region.name != first
        assert client.shared.calls == 5


def test_a_reply_larger_than_the_request_gets_a_larger_slice(trunk_server) -> None:
    _, trunk, _ = _mlp(width_out=4096)  # the trunk's output is 256x its input
    server = trunk_server(trunk, limits=ChannelLimits(stream_threshold_bytes=64 << 10))
    with TrunkClient(server.address, insecure=True, shared_memory="on") as client:
        for i in range(2):
            out, grad = _forward_backward(client, torch.randn(5, 16), f"a{i}")
            assert out.shape == (5, 4096) and grad.shape == (5, 16)
        assert client.shared.calls == 4  # the first Forward was sent again with room for its reply
    assert server.runtime.version == 2


def test_the_server_copies_a_request_before_using_it(trunk_server) -> None:
    # Overwriting the region after the Forward (as a client might, at any time) does not change what the trunk
    # saved for the Backward: the update equals one computed over the socket.
    _, trunk, _ = _mlp()
    via_region = trunk_server(copy.deepcopy(trunk), lr=0.1)
    via_socket = trunk_server(copy.deepcopy(trunk), lr=0.1)
    x = torch.randn(5, 16)
    with TrunkClient(via_region.address, insecure=True, shared_memory="on") as a, \
            TrunkClient(via_socket.address, insecure=True, shared_memory="off") as b:
        out, _ = a.forward(CutState(x), activation_id="a")
        a.shared.region.mapping.bytes.fill_(255)  # NaN everywhere in the region
        a.shared.mode = "off"
        a.backward("a", torch.ones_like(out))
        _forward_backward(b, x, "b")
    for p, q in zip(via_region.runtime.trunk.parameters(), via_socket.runtime.trunk.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_the_apps_on_one_host_carry_the_cut_through_shared_memory(tmp_path, mode: str) -> None:
    import json

    from flower_harness import run_apps

    _, out = run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=1, local_steps=4,
                      shared_memory=mode)
    train = json.loads((out / "history.json").read_text())["rounds"][0]["train"]
    sent, received, moved = (train[f"train-bytes-{k}"] for k in ("sent", "received", "shared"))
    assert sent > 0 and received > 0
    assert moved == (sent + received if mode == "auto" else 0)  # the CNN's activations and gradients, all of them


def test_a_region_closes_only_once_a_copy_its_reader_started_is_done() -> None:
    """A reader may start an asynchronous copy and hold its event as it leaves: closing the region meanwhile waits
    for the reader and then for that copy, never unmapping under it."""
    import threading
    import time

    region = SharedRegion.create(1 << 16)
    copied = threading.Event()

    class Copy:  # what the region sees of a CUDA event
        def query(self) -> bool:
            return copied.is_set()

        def synchronize(self) -> None:
            copied.wait(30)

    closed = threading.Event()
    closer = threading.Thread(target=lambda: (region.close(), closed.set()))
    with region.reading():
        closer.start()
        time.sleep(0.2)  # the close is waiting for this reader
        region.hold(Copy())  # type: ignore[arg-type]
    time.sleep(0.3)
    assert not closed.is_set()  # the reader left, its copy is still in flight
    copied.set()
    closer.join(30)
    assert closed.is_set()


def test_a_view_of_a_closed_region_stays_mapped_until_it_goes() -> None:
    """A slice a call still writes into or reads from when its region is closed (a model unloaded past its
    drain deadline, an idle sweep, the client closing it) stays mapped until the call lets it go: writing and
    reading it then is harmless, where it once hit unmapped memory and killed the server's process (run in a
    child process, so that a regression fails this test instead of ending the run)."""
    import subprocess
    import sys

    code = """
import gc
import torch
from splitfed.channel.transports.shm.regions import SharedRegion

def mapped(address, name):
    for line in open("/proc/self/maps"):
        span, *rest = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= address < hi:
            return name in line
    return False

region = SharedRegion.create(1 << 20)
view = region.view(4096, 1 << 16)
view.fill_(5)
region.close()
gc.collect()
assert mapped(view.data_ptr(), region.name), "the slice was unmapped under its view"
assert int(view.sum()) == 5 * (1 << 16)
view.fill_(7)
torch.zeros(1 << 16, dtype=torch.uint8).copy_(view)
address, name = view.data_ptr(), region.name
del view
gc.collect()
assert not mapped(address, name), "the mapping outlived its last view"
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


def _identity() -> nn.Module:
    return split_sequential(nn.Sequential(nn.Identity(), nn.Identity(), nn.Identity()), 1, 2)[1]


def test_a_region_too_small_for_a_larger_tensor_is_replaced_by_a_larger_one(trunk_server) -> None:
    server = trunk_server(_identity())
    with TrunkClient(server.address, insecure=True, shared_memory="on") as client:
        small = torch.randn(64, 256)  # 64 KiB: the first region is sized for calls like this one (4 MiB)
        assert torch.equal(client.forward(CutState(small), train=False)[0], small)
        first = client.shared.region
        assert first.mapping.nbytes == 4 * MiB
        large = torch.randn(3 * MiB // 1024, 256)  # 3 MiB, and as much for its reply: more than the whole region
        assert torch.equal(client.forward(CutState(large), train=False)[0], large)
        second = client.shared.region
        assert second is not first and first.broken and second.mapping.nbytes >= 6 * MiB
        assert client.shared.calls == 2 and client.shared.bytes == 2 * (small.nbytes + large.nbytes)
        assert server.servicer.regions.total_bytes == second.mapping.nbytes  # the first one is closed there too
        assert torch.equal(client.forward(CutState(small), train=False)[0], small)
        assert client.shared.region is second and client.shared.calls == 3


def test_a_region_in_use_is_not_replaced_and_its_larger_call_takes_the_socket(trunk_server) -> None:
    server = trunk_server(_identity())
    with TrunkClient(server.address, insecure=True, shared_memory="on") as client:
        client.forward(CutState(torch.randn(64, 256)), train=False)
        first = client.shared.region
        held = first.take(4096)  # a slice another thread's call holds
        large = torch.randn(3 * MiB // 1024, 256)
        assert torch.equal(client.forward(CutState(large), train=False)[0], large)
        assert client.shared.region is first and not first.broken and client.shared.calls == 1
        first.give(held)
        assert torch.equal(client.forward(CutState(large), train=False)[0], large)
        assert client.shared.region is not first and client.shared.calls == 2


def test_a_client_asks_for_no_more_than_the_server_grants(trunk_server) -> None:
    server = trunk_server(_identity(), shared_memory_bytes=4 * MiB)
    with TrunkClient(server.address, insecure=True, shared_memory="on") as client:
        client.forward(CutState(torch.randn(64 * 16, 256)), train=False)  # 1 MiB: asks for 16, is granted 4
        first = client.shared.region
        assert first.mapping.nbytes == 4 * MiB and client.shared.nbytes == 4 * MiB
        large = torch.randn(3 * MiB // 1024, 256)
        for _ in range(2):  # over the socket, with the region kept: no region opened per call
            assert torch.equal(client.forward(CutState(large), train=False)[0], large)
        assert client.shared.region is first and not first.broken and client.shared.calls == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_clients_region_grows_with_its_gpu_memory(trunk_server) -> None:
    # CUDA tensors on both sides: the region has CUDA events and a twin in the trunk's GPU memory; the larger one
    # that replaces it has them too, and the copies stay on the GPU.
    layers = [nn.Linear(256, 256) for _ in range(3)]
    with torch.no_grad():
        for layer in layers:
            layer.weight.copy_(torch.eye(256))
            layer.bias.zero_()
    trunk = split_sequential(nn.Sequential(*layers), 1, 2)[1].to("cuda")
    server = trunk_server(trunk)
    with TrunkClient(server.address, insecure=True, shared_memory="on") as client:
        small = torch.randn(64, 256, device="cuda")
        assert torch.equal(client.forward(CutState(small), train=False)[0].to(small.device), small)
        first = client.shared.region
        assert first.device_memory is not None and client.shared.on_gpu == 1
        large = torch.randn(3 * MiB // 1024, 256, device="cuda")
        assert torch.equal(client.forward(CutState(large), train=False)[0].to(large.device), large)
        second = client.shared.region
        assert second is not first and second.mapping.nbytes >= 6 * MiB and second.device_memory is not None
        assert client.shared.on_gpu == 2 and client.shared.calls == 2


def test_a_larger_region_the_server_will_not_open_leaves_the_client_on_its_old_size(trunk_server) -> None:
    server = trunk_server(_identity())
    with TrunkClient(server.address, insecure=True, shared_memory="on") as client:
        small = CutState(torch.randn(64, 256))
        client.forward(small, train=False)
        server.servicer.regions.max_total_bytes = 5 * MiB  # room for a region of 4 MiB, not for a larger one
        large = torch.randn(3 * MiB // 1024, 256)
        assert torch.equal(client.forward(CutState(large), train=False)[0], large)  # over the socket
        assert client.shared.mode == "on" and client.shared.nbytes == 4 * MiB and client.shared.calls == 1
        client.forward(small, train=False)  # through a region of the old size again
        again = client.shared.region
        assert again.mapping.nbytes == 4 * MiB and not again.broken and client.shared.calls == 2
        assert torch.equal(client.forward(CutState(large), train=False)[0], large)
        assert client.shared.region is again and not again.broken and client.shared.calls == 2
