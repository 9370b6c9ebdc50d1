"""TLS bulk links: a TLS trunk server's bulk links are TLS too, with the gRPC server's certificate, verified by the
client against its channel's trust root; each direction on connections of its own (splitfed.channel.security.bulktls).
The certificates are made with ``openssl`` as an operator would (``tests/pki.py``)."""

from __future__ import annotations

import copy
import socket
import ssl
from pathlib import Path

import grpc
import pytest
import torch
from conftest import batch_for, tiny_model
from pki import Pki, make_pki
from serverproc import end_on_sigterm
from test_bulk import LIMITS, STEPS, _closed, _max_diff, side_by_side, small_stripes  # noqa: F401 - the fixture applies here too

from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.wire import split_channel_pb2_grpc as pb_grpc
from splitfed.channel.transports.bulk.links import hello
from splitfed.channel.wire.framing import send_frame
from splitfed.channel.security.bulktls import BulkTLS, server_context
from splitfed.channel.client.remote import RemoteTrunk
from splitfed.channel.client.trunk import TrunkClient
from splitfed.channel.wire.limits import CLIENT_ID_KEY, ChannelLimits
from splitfed.channel.security.credentials import channel_credentials, server_credentials
from splitfed.errors import ConfigError
from splitfed.split import SplitModel, split_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), nodes=1)


def _pem(path: str) -> bytes:
    return Path(path).read_bytes()


def _server(trunk_server, trunk: torch.nn.Module, pki: Pki, client_ca: bool = False):  # type: ignore[no-untyped-def]
    ca = pki.cert("ca") if client_ca else None
    return trunk_server(trunk, insecure=False, credentials=server_credentials(pki.cert("server"), pki.key("server"),
                                                                              ca),
                        lr=0.05, limits=LIMITS, bulk_connections=3,
                        bulk_tls=server_context(_pem(pki.cert("server")), _pem(pki.key("server")),
                                                None if ca is None else _pem(ca)))


def _client_kwargs(pki: Pki, trusted: str = "ca", node: str | None = None) -> dict:
    pair = {} if node is None else {"client_cert": pki.cert(node), "client_key": pki.key(node)}
    return {"credentials": channel_credentials(pki.cert("ca"), **pair),
            "bulk_tls": BulkTLS.client(_pem(pki.cert(trusted)), **pair)}


def _train(arch: str, trunk_server, pki: Pki, client_ca: bool = False,
           **client: object):  # type: ignore[no-untyped-def]
    """``STEPS`` SGD steps of the split model over TLS against the unsplit one (``client_ca``: the server asks
    for client certificates); returns the largest weight difference, the server and the client's trunk."""
    model = tiny_model(arch).train()
    ref = copy.deepcopy(model)
    inputs, mask, labels = batch_for(arch, batch=6, padded=True)
    split = split_model(model, (1, 3))
    server = _server(trunk_server, split.trunk, pki, client_ca=client_ca)
    remote = RemoteTrunk(server.address, limits=LIMITS, shared_memory="off", bulk_connections=3,
                         **(client or _client_kwargs(pki)))
    net = SplitModel(split.bottom, remote, split.top, task=split.task)
    opt = torch.optim.SGD(split.client_modules().parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    side_by_side(net, opt, ref, ref_opt, (inputs, mask, labels))
    return _max_diff(model, ref), server, remote


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_sgd_steps_over_a_tls_bulk_link_equal_the_unsplit_model(arch: str, trunk_server, pki: Pki,
                                                                 small_stripes: None) -> None:
    diff, server, remote = _train(arch, trunk_server, pki)
    client = remote.client
    link = client.bulk.link
    assert diff <= 1e-6 and server.runtime.version == STEPS
    assert client.bulk.calls == 2 * STEPS and client.bulk.failed is None  # every Forward and Backward
    assert link.bytes_sent == client.bytes_sent and link.bytes_received == client.bytes_received
    (_, served), = server.bulk._links.values()
    for end in (link, served):  # TLS everywhere, each connection one way
        assert len(end.socks) == len(end.out_socks) == 3 and not set(end.socks) & set(end.out_socks)
        assert all(isinstance(s, ssl.SSLSocket) for s in [*end.socks, *end.out_socks])
    remote.close()


def test_a_client_that_does_not_trust_the_servers_certificate_streams_over_grpc(trunk_server, pki: Pki,
                                                                                 small_stripes: None) -> None:
    # The channel trusts the server; the link is told to trust another CA only: its TLS handshake fails before
    # the ticket goes, and the calls stream over gRPC (still TLS), exactly.
    diff, _, remote = _train("gpt2", trunk_server, pki, credentials=channel_credentials(pki.cert("ca")),
                             bulk_tls=BulkTLS.client(_pem(pki.cert("other-ca"))))
    assert diff <= 1e-6
    assert remote.client.bulk.calls == 0 and "certificate verify failed" in remote.client.bulk.failed
    remote.close()


def test_a_plaintext_connection_to_a_tls_links_port_is_refused(trunk_server, pki: Pki) -> None:
    server = _server(trunk_server, split_model(tiny_model("gpt2"), (1, 3)).trunk, pki)
    with grpc.secure_channel(server.address, channel_credentials(pki.cert("ca"))) as channel:
        offer = pb_grpc.SplitChannelStub(channel).OpenBulk(pb.OpenBulkRequest(connections=1), timeout=10,
                                                           metadata=[(CLIENT_ID_KEY, "alice")])
    with socket.create_connection(("127.0.0.1", offer.port), timeout=10) as sock:
        send_frame(sock, hello(offer.ticket, 0))  # a valid ticket, in the clear
        assert _closed(sock)
    (pending,) = server.bulk._offers.values()
    assert pending.socks == [None, None]  # nothing attached; a TLS link of 1 connection has one each way


def test_mutual_tls_links_need_the_clients_certificate(trunk_server, pki: Pki, small_stripes: None) -> None:
    diff, _, remote = _train("gpt2", trunk_server, pki, client_ca=True, **_client_kwargs(pki, node="node-0"))
    assert diff <= 1e-6 and remote.client.bulk.calls == 2 * STEPS
    remote.close()
    # The channel presents the node's certificate; the link presents none: the server refuses its connections.
    pair = {"client_cert": pki.cert("node-0"), "client_key": pki.key("node-0")}
    diff, _, remote = _train("gpt2", trunk_server, pki, client_ca=True,
                             credentials=channel_credentials(pki.cert("ca"), **pair),
                             bulk_tls=BulkTLS.client(_pem(pki.cert("ca"))))
    assert diff <= 1e-6 and remote.client.bulk.calls == 0 and remote.client.bulk.failed is not None
    remote.close()


def test_tls_and_bulk_tls_go_together(pki: Pki) -> None:
    from splitfed.channel.server.trunkserver import TrunkServer

    creds = server_credentials(pki.cert("server"), pki.key("server"))
    context = server_context(_pem(pki.cert("server")), _pem(pki.key("server")))
    with pytest.raises(ConfigError, match="need TLS too"):
        TrunkServer(torch.nn.Linear(2, 2), credentials=creds, bulk_connections=2)
    with pytest.raises(ConfigError, match="for a TLS server"):
        TrunkServer(torch.nn.Linear(2, 2), insecure=True, bulk_connections=2, bulk_tls=context)
    with pytest.raises(ConfigError, match="BulkTLS.client"):
        TrunkClient("127.0.0.1:1", credentials=channel_credentials(pki.cert("ca")), bulk_connections=2)
    with pytest.raises(ConfigError, match="for a TLS channel"):
        TrunkClient("127.0.0.1:1", insecure=True, bulk_connections=2, bulk_tls=BulkTLS.client(_pem(pki.cert("ca"))))
    with pytest.raises(ConfigError, match="do not load"):
        server_context(_pem(pki.cert("server")), _pem(pki.key("node-0")))  # another certificate's key
    with pytest.raises(ConfigError, match="not PEM"):
        BulkTLS.client(b"not a certificate")


def test_splitfed_serve_with_tls_offers_tls_bulk_links(pki: Pki) -> None:
    import subprocess
    import sys
    import time
    import uuid

    from test_serving import CNN_INPUT
    from test_serving_cli import _free_port

    from splitfed.errors import ChannelError
    from splitfed.split import CutState

    port, bulk_port = _free_port(), _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "splitfed.cli", "serve", "--model", "cnn=mnist-cnn:3,6",
                             "--port", str(port), "--tls-cert", pki.cert("server"), "--tls-key", pki.key("server"),
                             "--bulk-connections", "2", "--bulk-port", str(bulk_port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with TrunkClient(f"127.0.0.1:{port}", model="cnn", shared_memory="off", bulk_connections=2,
                         limits=ChannelLimits(stream_threshold_bytes=1 << 10), **_client_kwargs(pki)) as cnn:
            deadline = time.monotonic() + 120
            while True:  # the server serves while it loads the model
                try:
                    assert list(cnn.info().cuts) == [3, 6]
                    break
                except (ChannelError, AssertionError):
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise
                    time.sleep(0.2)
            act = uuid.uuid4().hex
            out, _ = cnn.forward(CutState(torch.randn(*CNN_INPUT)), activation_id=act, train=True)
            assert cnn.backward(act, torch.ones_like(out)).trunk_version == 1
            assert cnn.bulk.calls == 2 and cnn.bulk.failed is None
            assert all(isinstance(s, ssl.SSLSocket) and s.getpeername()[1] == bulk_port for s in cnn.bulk.link.socks)
    finally:
        out = end_on_sigterm(proc)
    assert proc.returncode == 0, out[-3000:]
