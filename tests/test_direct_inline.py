"""Small calls over the direct link (SharedLane.inline): once a client has a shared-memory region with a direct-call
link, its Forward and Backward calls whose tensors are too small for the region travel inline over that link instead
of gRPC, compute exactly what gRPC calls compute, and a refused one leaves the link and the region in use. A client
on the trunk's host whose tensors are all small opens a small region for the link with its first call."""

from __future__ import annotations

import copy
import uuid

import pytest
import torch
from torch import nn

from splitfed.channel.client.trunk import TrunkClient
from splitfed.channel.transports.shm.lane import LINK_REGION_BYTES
from splitfed.channel.transports.shm.regions import MIN_REGION_TENSOR_BYTES
from splitfed.errors import ChannelError
from splitfed.split import CutState
from splitfed.split.sequential import split_sequential

WIDTH = 256
#: Rows of a tensor large enough for the region (it opens the region and its link).
LARGE = MIN_REGION_TENSOR_BYTES // (4 * WIDTH)


def _trunk() -> nn.Module:
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))
    return split_sequential(layers, 1, 2)[1]


def _small_steps(client: TrunkClient, n: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(1)
    client.forward(CutState(torch.randn(LARGE, WIDTH)), train=False)  # through the region
    seen = []
    for _ in range(n):
        act = uuid.uuid4().hex
        out, _ = client.forward(CutState(torch.randn(5, WIDTH)), activation_id=act)  # 5 KiB: inline
        seen += [out, client.backward(act, out * 0.5).grad]
    return seen


def test_small_calls_take_the_direct_link_and_compute_what_grpc_calls_compute(trunk_server) -> None:
    trunk = _trunk()
    direct = trunk_server(copy.deepcopy(trunk))
    grpc_only = trunk_server(copy.deepcopy(trunk), direct_calls=False)
    with TrunkClient(direct.address, insecure=True) as a, TrunkClient(grpc_only.address, insecure=True) as b:
        got, want = _small_steps(a), _small_steps(b)
        assert a.shared.calls == 1 and a.shared.inline_calls == 6 and a.shared.direct_calls == 7
        assert b.shared.calls == 1 and b.shared.inline_calls == 0 and b.shared.direct_calls == 0
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x, y)
    for p, q in zip(direct.runtime.trunk.parameters(), grpc_only.runtime.trunk.parameters(), strict=True):
        assert torch.equal(p, q)
    assert direct.direct.listener.stats["calls"] == 7


def test_a_client_whose_calls_are_all_small_opens_a_small_region_for_its_link(trunk_server) -> None:
    trunk = _trunk()
    server, other = trunk_server(copy.deepcopy(trunk)), trunk_server(copy.deepcopy(trunk))
    with TrunkClient(server.address, insecure=True) as client, \
            TrunkClient(other.address, insecure=True, shared_memory="off") as remote:
        x = torch.randn(5, WIDTH)
        seen = []
        for c in (client, remote):
            act = uuid.uuid4().hex
            out, _ = c.forward(CutState(x), activation_id=act)
            seen += [out, c.backward(act, out).grad]
        region = client.shared.region
        assert region is not None and region.mapping.nbytes == LINK_REGION_BYTES and region.direct is not None
        assert client.shared.inline_calls == 2 and client.shared.calls == 0  # no tensor took a slice
        assert remote.shared.region is None and remote.shared.inline_calls == 0  # over gRPC
    assert server.direct.listener.stats["calls"] == 2 and other.direct.listener.stats["calls"] == 0
    assert torch.equal(seen[0], seen[2]) and torch.equal(seen[1], seen[3])
    for p, q in zip(server.runtime.trunk.parameters(), other.runtime.trunk.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_server_without_direct_calls_leaves_small_calls_on_grpc_after_one_region(trunk_server) -> None:
    server = trunk_server(_trunk(), direct_calls=False)
    with TrunkClient(server.address, insecure=True) as client:
        for _ in range(3):
            act = uuid.uuid4().hex
            out, _ = client.forward(CutState(torch.randn(5, WIDTH)), activation_id=act)
            client.backward(act, out)
        assert client.shared.region is not None and client.shared.region.direct is None
        assert client.shared.inline_calls == 0
    assert server.servicer.regions.total_bytes == 0  # the client closed its one region


@pytest.mark.parametrize("bad", ["nan", "shape"])
def test_a_refused_small_call_over_the_link_is_a_clear_error_and_the_link_serves_on(trunk_server, bad: str) -> None:
    server = trunk_server(_trunk())
    with TrunkClient(server.address, insecure=True) as client:
        client.forward(CutState(torch.randn(LARGE, WIDTH)), train=False)
        x = torch.randn(5, WIDTH)
        if bad == "nan":
            x[2, 3] = float("nan")
        else:
            x = torch.randn(5, WIDTH + 1)
        with pytest.raises(ChannelError) as err:
            client.forward(CutState(x), train=False)
        assert err.value.code == "INVALID_ARGUMENT"
        assert ("NaN" in str(err.value)) if bad == "nan" else ("could not process the input" in str(err.value))
        assert client.shared.inline_calls == 0 and client.shared.region is not None
        assert not client.shared.region.broken and client.shared.region.direct is not None
        out, _ = client.forward(CutState(torch.ones(5, WIDTH)), train=False)
        assert out.shape == (5, WIDTH) and client.shared.inline_calls == 1
    assert server.direct.listener.stats["calls"] == 3


def test_a_small_call_whose_ticket_ended_goes_over_grpc_once_and_is_answered(trunk_server) -> None:
    # The region closes on the server while the client still holds it (no slice of a small call keeps it open):
    # the link answers UNAUTHENTICATED before anything runs, and the call goes over gRPC instead.
    from splitfed.channel.wire import split_channel_pb2 as pb

    server = trunk_server(_trunk())
    with TrunkClient(server.address, insecure=True) as client:
        client.forward(CutState(torch.randn(LARGE, WIDTH)), train=False)
        region = client.shared.region
        client._stub.CloseRegion(pb.CloseRegionRequest(region=region.name), metadata=client._metadata)
        x = torch.ones(5, WIDTH)
        out, _ = client.forward(CutState(x), train=False)
        assert region.direct is None and client.shared.inline_calls == 0
        again, _ = client.forward(CutState(x), train=False)  # over gRPC from now on
        assert torch.equal(out, again) and client.shared.inline_calls == 0
    with torch.no_grad():
        want = server.runtime.trunk(CutState(x)).hidden
    assert (out - want).abs().max() < 1e-5
    assert server.direct.listener.stats["calls"] == 2  # the region's own call, and the one refused at its ticket
