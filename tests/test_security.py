"""TLS (and mutual TLS) on the split channel, per-client tokens, and who may touch what."""

from __future__ import annotations

import datetime
import json
import uuid
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from splitfed.channel.security.tokens import TokenIssuer
from splitfed.channel.client.trunk import RetryPolicy, TrunkClient
from splitfed.channel.security.credentials import channel_credentials, server_credentials
from splitfed.errors import AuthError, ChannelError
from splitfed.split import CutState, split_model


def _cert(tmp: Path, name: str, issuer_key=None, issuer_name=None, ca: bool = False):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name or subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))
    if ca:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    else:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                                     x509.IPAddress(__import__("ipaddress")
                                                                                    .ip_address("127.0.0.1"))]),
                                        critical=False)
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    (tmp / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                        serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))
    return key, subject


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate, all signed by the CA."""
    ca_key, ca_name = _cert(tmp_path, "ca", ca=True)
    _cert(tmp_path, "server", ca_key, ca_name)
    _cert(tmp_path, "client", ca_key, ca_name)
    _cert(tmp_path, "stranger")  # self-signed, not from our CA
    return tmp_path


def _trunk():
    return split_model(tiny_model("llama").train(), cuts=(1, 3)).trunk


def _state() -> CutState:
    return CutState(torch.randn(2, 5, 32))


def test_mutual_tls_requires_a_client_certificate_from_the_ca(pki: Path, trunk_server) -> None:
    server = trunk_server(_trunk(), insecure=False, credentials=server_credentials(
        pki / "server.pem", pki / "server.key", client_ca=pki / "ca.pem"))
    good = TrunkClient(server.address, credentials=channel_credentials(pki / "ca.pem", pki / "client.pem",
                                                                        pki / "client.key"))
    assert good.forward(_state(), train=False)[0].shape == (2, 5, 32)
    for creds in (channel_credentials(pki / "ca.pem"),
                  channel_credentials(pki / "ca.pem", pki / "stranger.pem", pki / "stranger.key")):
        with pytest.raises(ChannelError):
            TrunkClient(server.address, credentials=creds).forward(_state(), train=False)


def test_token_issuer_refusals() -> None:
    now = [1000.0]
    issuer = TokenIssuer("run-1", secret=b"k" * 32, ttl_s=60, clock=lambda: now[0])
    token = issuer.issue(node=7, server_round=2)
    assert issuer.verify(token).client_id == "node-7"
    body, sig = token.split(".")
    cases = {
        "": "malformed", "abc": "malformed", f"{body}.{sig[:-2]}xx": "signature",
        f"{body[:-3]}AAA.{sig}": "signature",
        TokenIssuer("run-1", secret=b"x" * 32).issue(7, 2): "not issued by this server",
        TokenIssuer("run-2", secret=b"k" * 32, clock=lambda: now[0]).issue(7, 2): "run",
    }
    for bad, fragment in cases.items():
        with pytest.raises(AuthError, match=fragment):
            issuer.verify(bad)
    issuer.issue(node=8, server_round=3)  # round 3 starts: round-2 tokens are replays now
    with pytest.raises(AuthError, match="replayed"):
        issuer.verify(token)
    fresh = issuer.issue(node=7, server_round=3)
    now[0] += 61
    with pytest.raises(AuthError, match="expired"):
        issuer.verify(fresh)
    with pytest.raises(AuthError, match="missing"):
        issuer.authenticate({})
    with pytest.raises(AuthError, match="Bearer"):
        issuer.authenticate({"authorization": "Basic abc"})


def test_server_refuses_bad_tokens_and_foreign_activations(trunk_server) -> None:
    issuer = TokenIssuer("run-9")
    trunk = _trunk()
    server = trunk_server(trunk, authenticate=issuer.authenticate)
    alice = TrunkClient(server.address, insecure=True, token=issuer.issue(1, 1))
    mallory = TrunkClient(server.address, insecure=True, token=issuer.issue(2, 1))
    anonymous = TrunkClient(server.address, insecure=True)
    forged = TrunkClient(server.address, insecure=True, token=TokenIssuer("run-9").issue(1, 1))
    for client in (anonymous, forged):
        with pytest.raises(ChannelError) as info:
            client.forward(_state(), train=True)
        assert info.value.code == "UNAUTHENTICATED"
    act = uuid.uuid4().hex
    out, _ = alice.forward(_state(), activation_id=act, train=True)
    with pytest.raises(ChannelError) as info:
        mallory.backward(act, torch.ones_like(out))
    assert info.value.code == "PERMISSION_DENIED"
    # The forward is still Alice's to finish, and only hers.
    assert alice.backward(act, torch.ones_like(out)).outcome == "APPLIED"
    # A token of an earlier round is a replay once the next round's tokens are issued.
    issuer.issue(1, 2)
    with pytest.raises(ChannelError) as info:
        alice.forward(_state(), train=False)
    assert info.value.code == "UNAUTHENTICATED" and "replayed" in str(info.value)


# -- zero-configuration TLS through the real apps ---------------------------------------------------
FAIL_FAST = RetryPolicy(max_attempts=2, initial_backoff_s=0.05)  # a refused handshake is not transient


def _trunk_records(grid) -> list:
    from splitfed.run.messages import splitfed_values

    return [splitfed_values(m.content["config"]) for m in grid.sent]


def test_apps_off_loopback_serve_zero_config_tls_and_reissue_it_on_resume(tmp_path: Path) -> None:
    from flower_harness import run_apps

    from splitfed.channel.security.policy import CA_FILE

    grid, out = run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=1, local_steps=3,
                         trunk_bind="0.0.0.0")
    first_ca = (out / CA_FILE).read_text()
    records = _trunk_records(grid)
    assert len(records) == 4 and all(r["trunk-ca"] == first_ca for r in records)  # train + evaluate, 2 nodes
    history = json.loads((out / "history.json").read_text())
    assert history["rounds"][0]["train"]["train-steps"] == 2 * 3  # both clients trained through TLS
    assert all(b"PRIVATE KEY" not in p.read_bytes() for p in out.rglob("*") if p.is_file())
    # A restarted ServerApp issues a new certificate and sends the new CA with the next round.
    grid, out = run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=2, local_steps=3,
                         trunk_bind="0.0.0.0", resume=True)
    second_ca = (out / CA_FILE).read_text()
    assert second_ca != first_ca
    assert {r["trunk-ca"] for r in _trunk_records(grid)} == {second_ca}
    assert {int(r["server-round"]) for r in _trunk_records(grid)} == {2}
    history = json.loads((out / "history.json").read_text())
    assert [r["round"] for r in history["rounds"]] == [1, 2] and history["rounds"][1]["train"]["train-steps"] == 6


def test_apps_refuse_plaintext_off_loopback_unless_asked_twice(tmp_path: Path) -> None:
    from flower_harness import run_apps
    from test_autotls import transport_warnings

    from splitfed.channel.security.policy import CA_FILE
    from splitfed.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        run_apps(tmp_path, num_nodes=2, num_server_rounds=1, local_steps=2, trunk_bind="0.0.0.0",
                 trunk_insecure=True)
    assert "trunk-insecure = false" in str(info.value) and "trunk-allow-plaintext-remote = true" in str(info.value)
    assert not (tmp_path / "outputs" / "history.json").exists()
    with transport_warnings() as messages:
        grid, out = run_apps(tmp_path, num_nodes=2, num_server_rounds=2, local_steps=2, trunk_bind="0.0.0.0",
                             trunk_insecure=True, trunk_allow_plaintext_remote=True)
    assert all("trunk-ca" not in r for r in _trunk_records(grid)) and not (out / CA_FILE).exists()
    warned = [m for m in messages if "PLAINTEXT on a non-loopback" in m]
    assert [m.split(":")[0] for m in warned] == ["round 1", "round 2"]
    # On loopback the default stays plaintext and certificate-free (the simulation).
    grid, out = run_apps(tmp_path, num_nodes=2, num_server_rounds=1, local_steps=2)
    assert all("trunk-ca" not in r for r in _trunk_records(grid)) and not (out / CA_FILE).exists()


def test_a_client_pinning_another_ca_is_refused(trunk_server) -> None:
    from splitfed.channel.security.autotls import issue
    from splitfed.channel.security.policy import (
        ServerTransport,
        TransportMode,
        client_credentials,
    )

    transport = ServerTransport(TransportMode.AUTO_TLS, bind="127.0.0.1", issued=issue(["127.0.0.1"]))
    server = trunk_server(_trunk(), insecure=False, credentials=transport.credentials())
    good = TrunkClient(server.address, credentials=client_credentials(server.address, pinned_ca=transport.ca_pem))
    assert good.forward(_state(), train=False)[0].shape == (2, 5, 32)
    another_ca = client_credentials(server.address, pinned_ca=issue(["127.0.0.1"]).ca_pem)
    system_roots = client_credentials(server.address, own_tls=True)  # no public CA vouches for it either
    for creds in (another_ca, system_roots):
        with pytest.raises(ChannelError) as info:
            TrunkClient(server.address, credentials=creds, retry=FAIL_FAST).forward(_state(), train=False)
        assert info.value.code == "UNAVAILABLE"


def test_run_config_defaults_to_tls_off_loopback_and_names_the_keys() -> None:
    from splitfed.config import RunConfig
    from splitfed.errors import ConfigError

    assert RunConfig().trunk_insecure is False and RunConfig().trunk_allow_plaintext_remote is False
    RunConfig.from_mapping({"trunk-bind": "0.0.0.0"})  # zero-configuration TLS: nothing else to set
    RunConfig.from_mapping({"trunk-bind": "0.0.0.0", "trunk-insecure": True, "trunk-allow-plaintext-remote": True})
    for settings, fragment in [
        ({"trunk-bind": "0.0.0.0", "trunk-insecure": True}, "trunk-allow-plaintext-remote = true"),
        ({"trunk-advertise": "trunk.example.org:50051", "trunk-insecure": True}, "trunk.example.org"),
        ({"tls-cert": "server.pem"}, "tls-cert and tls-key go together"),
        ({"tls-cert": "s.pem", "tls-key": "s.key", "trunk-insecure": True}, "remove trunk-insecure"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            RunConfig.from_mapping(settings)
