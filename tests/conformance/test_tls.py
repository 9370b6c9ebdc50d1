"""TLS over every transport where it applies: a TLS server carries the transport's calls (the gRPC channel, and a
bulk link's connections, under TLS), exactly; a plaintext client and one that does not trust the server's CA are
refused (UNAVAILABLE, in the handshake) and nothing changes. Certificates are made with ``openssl`` as an operator
would (tests/pki.py)."""

from __future__ import annotations

import ssl
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from pki import Pki, make_pki

from splitfed.channel.security.bulktls import BulkTLS, server_context
from splitfed.channel.security.credentials import channel_credentials, server_credentials
from splitfed.channel.wire.retry import RetryPolicy
from splitfed.errors import ChannelError
from splitfed.split import CutState

from .transports import Transport, hidden, snapshot, trunk, unchanged

FAIL_FAST = RetryPolicy(max_attempts=1, timeout_s=5.0)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), nodes=1)


def _pem(path: str) -> bytes:
    return Path(path).read_bytes()


def _server_tls(transport: Transport, pki: Pki) -> dict[str, Any]:
    tls: dict[str, Any] = {"credentials": server_credentials(pki.cert("server"), pki.key("server"))}
    if transport.server.get("bulk_connections"):
        tls["bulk_tls"] = server_context(_pem(pki.cert("server")), _pem(pki.key("server")))
    if transport.server.get("frontends"):  # front-end processes load the PEM files themselves
        tls["frontend_tls"] = (_pem(pki.key("server")), _pem(pki.cert("server")), None)
    return tls


def _client_tls(transport: Transport, pki: Pki, ca: str = "ca") -> dict[str, Any]:
    tls: dict[str, Any] = {"credentials": channel_credentials(pki.cert(ca))}
    if transport.client.get("bulk_connections"):
        tls["bulk_tls"] = BulkTLS.client(_pem(pki.cert(ca)))
    return tls


def test_a_tls_server_carries_the_transport_and_refuses_plaintext(transport: Transport, pki: Pki) -> None:
    server = transport.open_server(trunk(), **_server_tls(transport, pki))
    client = transport.open_client(server, **_client_tls(transport, pki))
    try:
        # Execute: a step over TLS; it goes over the transport and equals the trunk's own computation.
        reference = trunk().to(transport.device)
        x = hidden().to(transport.device)
        act = uuid.uuid4().hex
        out, _ = client.forward(CutState(x), activation_id=act)
        assert torch.equal(out.to(x.device), reference(CutState(x)).hidden.detach())
        assert client.backward(act, torch.zeros_like(out, device=x.device)).outcome == "APPLIED"
        assert transport.went(server, client) == 2, f"the calls did not go over {transport.name}"
        if transport.client.get("bulk_connections"):
            assert all(isinstance(s, ssl.SSLSocket) for s in client.bulk.link.socks)
        # Assert: plaintext, and a client trusting another CA, are refused in the handshake; nothing changed.
        snap = snapshot(server)
        plain = transport.open_client(server, retry=FAIL_FAST)
        stranger = transport.open_client(server, retry=FAIL_FAST, **_client_tls(transport, pki, ca="other-ca"))
        for refused in (plain, stranger):
            with pytest.raises(ChannelError) as info:
                refused.forward(CutState(x), activation_id=uuid.uuid4().hex)
            assert info.value.code == "UNAVAILABLE"
            refused.close()
        assert unchanged(server, snap)
    finally:
        client.close()
        server.stop(grace=0)
