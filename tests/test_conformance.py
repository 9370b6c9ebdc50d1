"""One conformance suite over every way a tensor crosses the cut: each test runs over gRPC (plaintext and TLS),
shared-memory regions (over gRPC), direct calls, bulk links (plaintext and TLS) and front-end processes, and checks
that the calls went that way. A transport added later gets every test by adding one line to ``TRANSPORTS``; CUDA IPC
(a GPU's regions) is not in it yet.

What each checks: split steps compute exactly what plain PyTorch computes (outputs, input gradients, the trunk's
weights after its optimizer's steps); a step id used twice is refused; a backward for an unknown step, with a gradient
of the wrong shape, sent twice, after an evaluation-only forward or for another client's step is refused with the
status the hostile-input catalogue names (docs/bad_inputs.md), and the channel serves on.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from pki import Pki, make_pki
from torch import nn

from splitfed.channel.client.trunk import TrunkClient
from splitfed.channel.security.bulktls import BulkTLS, server_context
from splitfed.channel.security.credentials import channel_credentials, server_credentials
from splitfed.channel.server.trunkserver import TrunkServer
from splitfed.channel.transports.shm import lane as shared
from splitfed.channel.wire.limits import ChannelLimits
from splitfed.errors import ChannelError
from splitfed.split import CutState
from splitfed.split.sequential import split_sequential

LR = 0.01
ROWS, HIDDEN = 6, 16


Settings = Callable[[Pki], dict[str, Any]]


@dataclass(frozen=True)
class Transport:
    """A way across the cut: the server's and the client's settings (given the run's certificates), and how to tell
    the calls went that way."""

    server: Settings
    client: Settings
    went: Callable[[TrunkServer, TrunkClient], int]


def _pem(path: str) -> bytes:
    return Path(path).read_bytes()


def _tls_server(p: Pki, **more: Any) -> dict[str, Any]:
    return {"insecure": False, "credentials": server_credentials(p.cert("server"), p.key("server")), **more}


def _tls_client(p: Pki, **more: Any) -> dict[str, Any]:
    return {"credentials": channel_credentials(p.cert("ca")), "shared_memory": "off", **more}


def _bulk_client(**more: Any) -> dict[str, Any]:
    return {"shared_memory": "off", "bulk_connections": 2, "limits": ChannelLimits(stream_threshold_bytes=256), **more}


def _over_grpc(server: TrunkServer, client: TrunkClient) -> int:
    return client.calls - client.shared.calls - client.bulk.calls


TRANSPORTS: dict[str, Transport] = {
    "grpc": Transport(lambda p: {}, lambda p: {"shared_memory": "off"}, _over_grpc),
    "grpc-tls": Transport(_tls_server, _tls_client, _over_grpc),
    "shm": Transport(lambda p: {"direct_calls": False}, lambda p: {},
                     lambda s, c: c.shared.calls - c.shared.direct_calls),
    "direct": Transport(lambda p: {}, lambda p: {}, lambda s, c: c.shared.direct_calls),
    "bulk": Transport(lambda p: {"bulk_connections": 2}, lambda p: _bulk_client(), lambda s, c: c.bulk.calls),
    "bulk-tls": Transport(
        lambda p: _tls_server(p, bulk_connections=2,
                              bulk_tls=server_context(_pem(p.cert("server")), _pem(p.key("server")))),
        lambda p: _tls_client(p, **_bulk_client(bulk_tls=BulkTLS.client(_pem(p.cert("ca"))))),
        lambda s, c: c.bulk.calls),
    "frontend": Transport(lambda p: {"frontends": 1}, lambda p: {"shared_memory": "off"},
                          lambda s, c: s.frontends.listener.stats["calls"]),
}


def _trunk() -> nn.Module:
    torch.manual_seed(0)
    return split_sequential(nn.Sequential(nn.Linear(8, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                                          nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, 4)), 1, 4)[1]


@dataclass
class Channel:
    name: str
    transport: Transport
    server: TrunkServer
    client: TrunkClient
    client_settings: dict[str, Any]

    def went(self) -> int:
        return self.transport.went(self.server, self.client)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), nodes=1)


def _secure(settings: dict[str, Any]) -> dict[str, Any]:
    return settings if "credentials" in settings else {"insecure": True, **settings}


@pytest.fixture(scope="module", params=sorted(TRANSPORTS))
def channel(request: pytest.FixtureRequest, pki: Pki) -> Iterator[Channel]:
    saved, shared.MIN_REGION_TENSOR_BYTES = shared.MIN_REGION_TENSOR_BYTES, 1  # small tensors go by region too
    transport = TRANSPORTS[request.param]
    server = TrunkServer(_trunk(), lr=LR, **_secure(transport.server(pki))).start()
    settings = _secure(transport.client(pki))
    client = TrunkClient(server.address, **settings)
    try:
        yield Channel(request.param, transport, server, client, settings)
    finally:
        client.close()
        server.stop(grace=0)
        shared.MIN_REGION_TENSOR_BYTES = saved


def test_split_steps_compute_what_plain_pytorch_computes(channel: Channel) -> None:
    trunk = copy.deepcopy(channel.server.runtime.trunk)  # the weights now: the module's earlier tests stepped too
    opt = torch.optim.SGD(trunk.parameters(), lr=LR)
    before = channel.went()
    torch.manual_seed(1)
    for _ in range(3):
        x = torch.randn(ROWS, HIDDEN)
        act = uuid.uuid4().hex
        out, _ = channel.client.forward(CutState(x), activation_id=act)
        x_ref = x.clone().requires_grad_(True)
        want = trunk(CutState(x_ref)).hidden
        assert torch.equal(out, want.detach())
        grad = channel.client.backward(act, out * 0.5).grad
        opt.zero_grad()
        want.backward(out * 0.5)
        opt.step()
        assert torch.equal(grad, x_ref.grad)
    for p, q in zip(channel.server.runtime.trunk.parameters(), trunk.parameters()):
        assert torch.equal(p, q)
    assert channel.went() >= before + 6, f"the calls did not go over {channel.name}"


def test_a_step_id_used_twice_is_refused(channel: Channel) -> None:
    act = uuid.uuid4().hex
    channel.client.forward(CutState(torch.randn(ROWS, HIDDEN)), activation_id=act)
    with pytest.raises(ChannelError) as info:
        channel.client.forward(CutState(torch.randn(ROWS, HIDDEN)), activation_id=act)
    assert info.value.code == "ALREADY_EXISTS"
    channel.client.backward(act, torch.zeros(ROWS, HIDDEN))  # the first forward's step still completes


BAD_BACKWARDS = [("unknown-step", "NOT_FOUND"), ("grad-shape", "INVALID_ARGUMENT"), ("twice", "FAILED_PRECONDITION"),
                 ("after-eval-forward", "NOT_FOUND"), ("another-clients-step", "PERMISSION_DENIED")]


@pytest.mark.parametrize(("case", "code"), BAD_BACKWARDS)
def test_a_bad_backward_is_refused_and_the_channel_serves_on(channel: Channel, case: str, code: str) -> None:
    act = uuid.uuid4().hex
    channel.client.forward(CutState(torch.randn(ROWS, HIDDEN)), activation_id=act, train=case != "after-eval-forward")
    if case == "twice":
        channel.client.backward(act, torch.zeros(ROWS, HIDDEN))
    other = TrunkClient(channel.server.address, client_id="mallory", **channel.client_settings) \
        if case == "another-clients-step" else channel.client
    try:
        with pytest.raises(ChannelError) as info:
            if case == "unknown-step":
                channel.client.backward(uuid.uuid4().hex, torch.ones(ROWS, HIDDEN))
            elif case == "grad-shape":
                channel.client.backward(act, torch.ones(ROWS + 1, HIDDEN))
            else:
                other.backward(act, torch.ones(ROWS, HIDDEN))
    finally:
        if other is not channel.client:
            other.close()
    assert info.value.code == code
    if case in ("unknown-step", "grad-shape", "another-clients-step"):
        channel.client.backward(act, torch.zeros(ROWS, HIDDEN))  # the step's own backward still completes
    out, _ = channel.client.forward(CutState(torch.randn(ROWS, HIDDEN)), train=False)
    assert out.shape == (ROWS, HIDDEN)
