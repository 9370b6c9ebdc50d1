"""Zero-configuration TLS: the ephemeral CA and server certificate (SANs, validity, key usage, chain), and the
transport policy that chooses plaintext, the operator's TLS or the ephemeral one."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from conftest import tiny_model
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitfed.channel.security.autotls import CLOCK_SKEW, DEFAULT_VALIDITY, issue, san_hosts
from splitfed.channel.client.trunk import RetryPolicy, TrunkClient
from splitfed.channel.security.credentials import pinned_channel_credentials
from splitfed.channel.security.policy import (
    CA_FILE,
    ServerTransport,
    TransportMode,
    advertised_host,
    choose_mode,
    client_credentials,
    host_of,
)
from splitfed.errors import ChannelError, ConfigError
from splitfed.split import CutState, split_model


def _certs(issued) -> tuple[x509.Certificate, x509.Certificate]:
    return x509.load_pem_x509_certificate(issued.ca_pem), x509.load_pem_x509_certificate(issued.cert_pem)


def _sans(cert: x509.Certificate) -> tuple[list[str], list[str]]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return san.get_values_for_type(x509.DNSName), [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]


# -- the certificates -----------------------------------------------------------------------------
def test_sans_cover_the_advertised_and_the_bound_host() -> None:
    # An advertised DNS name and a specific bound IP: both, as a DNS name and an IP address.
    dns, ips = _sans(_certs(issue(san_hosts("trunk.example.org", "10.20.30.40")))[1])
    assert dns == ["trunk.example.org"] and ips == ["10.20.30.40"]
    # A wildcard bind listens on loopback too; the wildcard itself is never a SAN.
    hosts = san_hosts("192.168.7.2", "0.0.0.0")
    assert hosts[:4] == ("192.168.7.2", "localhost", "127.0.0.1", "::1") and "0.0.0.0" not in hosts
    dns, ips = _sans(_certs(issue(hosts))[1])
    assert ips == ["192.168.7.2", "127.0.0.1", "::1"] and "localhost" in dns
    # IPv6 in brackets, case and duplicates are normalised.
    assert san_hosts("[FD00::1]", "fd00::1") == ("fd00::1",)
    assert _sans(_certs(issue(["[FD00::1]"]))[1])[1] == [str(ipaddress.ip_address("fd00::1"))]
    with pytest.raises(ValueError, match="at least one host"):
        issue(["0.0.0.0", "::"])


def test_validity_window_and_key_usage() -> None:
    before = datetime.datetime.now(datetime.timezone.utc)
    issued = issue(["10.0.0.1"])
    after = datetime.datetime.now(datetime.timezone.utc)
    ca, leaf = _certs(issued)
    for cert in (ca, leaf):
        assert before - CLOCK_SKEW - datetime.timedelta(seconds=1) <= cert.not_valid_before_utc <= after - CLOCK_SKEW
        assert before + DEFAULT_VALIDITY - datetime.timedelta(seconds=1) <= cert.not_valid_after_utc \
            <= after + DEFAULT_VALIDITY
        assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey) and cert.public_key().curve.name == "secp256r1"
    assert issue(["h"], validity=datetime.timedelta(hours=2))  # custom window
    with pytest.raises(ValueError, match="positive"):
        issue(["h"], validity=datetime.timedelta(0))
    # The CA signs server certificates only, one level deep.
    basic = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert basic.critical and basic.value.ca and basic.value.path_length == 0
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage)
    assert usage.critical and usage.value.key_cert_sign and usage.value.crl_sign and not usage.value.digital_signature
    # The server certificate is for TLS server authentication only.
    basic = leaf.extensions.get_extension_for_class(x509.BasicConstraints)
    assert basic.critical and not basic.value.ca
    usage = leaf.extensions.get_extension_for_class(x509.KeyUsage)
    assert usage.critical and usage.value.digital_signature and not usage.value.key_cert_sign
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert leaf.issuer == ca.subject and ca.issuer == ca.subject


def test_chain_verifies_for_the_covered_names_only() -> None:
    issued = issue(["trunk.example.org", "10.0.0.1"])
    ca, leaf = _certs(issued)
    leaf.verify_directly_issued_by(ca)
    verifier = PolicyBuilder().store(Store([ca]))
    for name in (x509.DNSName("trunk.example.org"), x509.IPAddress(ipaddress.ip_address("10.0.0.1"))):
        chain = verifier.build_server_verifier(name).verify(leaf, [])
        assert chain[-1] == ca
    with pytest.raises(VerificationError):
        verifier.build_server_verifier(x509.DNSName("evil.example.org")).verify(leaf, [])
    other = x509.load_pem_x509_certificate(issue(["trunk.example.org"]).ca_pem)
    with pytest.raises(VerificationError):  # another run's CA does not vouch for this certificate
        PolicyBuilder().store(Store([other])).build_server_verifier(x509.DNSName("trunk.example.org")).verify(leaf, [])


def test_private_keys_stay_in_memory(tmp_path: Path) -> None:
    transport = ServerTransport.from_settings("0.0.0.0", advertise="10.9.8.7:5000")
    assert "PRIVATE KEY" not in repr(transport.issued)
    path = transport.write_ca(tmp_path)
    assert path == tmp_path / CA_FILE and path.read_bytes() == transport.issued.ca_pem
    assert transport.ca_pem is not None and transport.ca_pem.startswith("-----BEGIN CERTIFICATE-----")
    assert [p.name for p in tmp_path.iterdir()] == [CA_FILE]
    assert all(b"PRIVATE KEY" not in p.read_bytes() for p in tmp_path.iterdir())
    # A later run without the ephemeral CA removes the stale certificate.
    assert ServerTransport.from_settings("127.0.0.1").write_ca(tmp_path) is None and not path.exists()


# -- over gRPC ----------------------------------------------------------------------------------
def _health(address: str, credentials: grpc.ChannelCredentials | None, **options: str) -> int:
    channel = grpc.secure_channel(address, credentials, options=list(options.items())) if credentials else \
        grpc.insecure_channel(address)
    with channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_grpc_pins_the_ephemeral_ca_and_checks_the_name(trunk_server) -> None:
    # On loopback the policy picks plaintext; the certificate is what the policy issues elsewhere.
    transport = ServerTransport(TransportMode.AUTO_TLS, bind="127.0.0.1",
                                issued=issue(san_hosts("localhost", "127.0.0.1")))
    server = trunk_server(split_model(tiny_model("llama").train(), cuts=(1, 3)).trunk, insecure=False,
                          credentials=transport.credentials())
    pinned = pinned_channel_credentials(transport.ca_pem)
    assert _health(server.address, pinned) == health_pb2.HealthCheckResponse.SERVING
    client = TrunkClient(f"localhost:{server.port}", credentials=client_credentials(
        f"localhost:{server.port}", pinned_ca=transport.ca_pem))
    out, _ = client.forward(CutState(torch.randn(2, 5, 32)), train=False)
    assert out.shape == (2, 5, 32)
    client.close()
    with pytest.raises(grpc.RpcError) as info:  # plaintext to a TLS port
        _health(server.address, None)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as info:  # a name the certificate does not cover
        _health(server.address, pinned, **{"grpc.ssl_target_name_override": "evil.example.org"})
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    stranger = client_credentials(server.address, pinned_ca=issue(["127.0.0.1", "localhost"]).ca_pem)
    with pytest.raises(ChannelError) as err:  # another CA's trust root, even for the right names
        TrunkClient(server.address, credentials=stranger, retry=RetryPolicy(max_attempts=2, initial_backoff_s=0.05)
                    ).forward(CutState(torch.randn(2, 5, 32)), train=False)
    assert err.value.code == "UNAVAILABLE"


# -- the policy ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("bind", "advertise", "insecure", "allow", "mode"), [
    ("127.0.0.1", "", False, False, TransportMode.PLAINTEXT),  # the simulation
    ("localhost", "127.0.0.1:5", False, False, TransportMode.PLAINTEXT),
    ("::1", "", True, False, TransportMode.PLAINTEXT),
    ("0.0.0.0", "", False, False, TransportMode.AUTO_TLS),
    ("10.1.1.1", "", False, False, TransportMode.AUTO_TLS),
    ("127.0.0.1", "trunk.example.org:443", False, False, TransportMode.AUTO_TLS),  # behind a TCP forwarder
    ("0.0.0.0", "", False, True, TransportMode.AUTO_TLS),  # the permission alone asks for nothing
    ("0.0.0.0", "", True, True, TransportMode.PLAINTEXT),  # plaintext on purpose
])
def test_choose_mode(bind: str, advertise: str, insecure: bool, allow: bool, mode: TransportMode) -> None:
    assert choose_mode(bind, advertise=advertise, insecure=insecure, allow_plaintext_remote=allow) is mode
    assert choose_mode(bind, advertise=advertise, tls_cert="c.pem", tls_key="k.pem") is TransportMode.TLS


def test_plaintext_off_loopback_is_refused_with_both_ways_out() -> None:
    for bind, advertise in (("0.0.0.0", ""), ("10.0.0.5", ""), ("127.0.0.1", "10.0.0.5:7000")):
        with pytest.raises(ConfigError) as info:
            choose_mode(bind, advertise=advertise, insecure=True)
        message = str(info.value)
        assert "trunk-insecure = false" in message and "trunk-allow-plaintext-remote = true" in message
        assert ("10.0.0.5" if advertise else bind) in message
    with pytest.raises(ConfigError, match="go together"):
        choose_mode("0.0.0.0", tls_cert="c.pem")
    with pytest.raises(ConfigError, match="remove trunk-insecure"):
        choose_mode("0.0.0.0", insecure=True, tls_cert="c.pem", tls_key="k.pem")


def test_client_refuses_plaintext_off_loopback() -> None:
    assert client_credentials("127.0.0.1:5000") is None and client_credentials("[::1]:5000") is None
    with pytest.raises(ConfigError, match="trunk-allow-plaintext-remote"):
        client_credentials("10.0.0.5:5000")
    assert client_credentials("10.0.0.5:5000", allow_plaintext_remote=True) is None
    assert isinstance(client_credentials("10.0.0.5:5000", pinned_ca=issue(["10.0.0.5"]).ca_pem),
                      grpc.ChannelCredentials)
    with pytest.raises(ConfigError, match="not PEM"):
        client_credentials("10.0.0.5:5000", pinned_ca="garbage")


def test_addresses() -> None:
    assert [host_of(a) for a in ("[::1]:50", "::1", "Trunk.Example.org:5", "10.0.0.1:3")] == \
        ["::1", "::1", "trunk.example.org", "10.0.0.1"]
    assert advertised_host("0.0.0.0") == "127.0.0.1" and advertised_host("10.0.0.1") == "10.0.0.1"
    assert advertised_host("0.0.0.0", "trunk.example.org:5") == "trunk.example.org"


@contextlib.contextmanager
def transport_warnings() -> Iterator[list[str]]:
    """Messages of the transport's warnings (listened to on its own logger: the apps' logging set-up stops
    propagation at the ``splitfed`` logger, so pytest's caplog may not see them)."""
    messages: list[str] = []
    listener = logging.Handler(logging.WARNING)
    listener.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("splitfed.channel.security.policy")
    logger.addHandler(listener)
    try:
        yield messages
    finally:
        logger.removeHandler(listener)


def test_plaintext_off_loopback_warns_every_round() -> None:
    with transport_warnings() as warned:
        transport = ServerTransport.from_settings("0.0.0.0", insecure=True, allow_plaintext_remote=True)
    assert transport.insecure and transport.credentials() is None and transport.ca_pem is None
    assert len(warned) == 1 and "PLAINTEXT on 0.0.0.0" in warned[0]  # at start
    with transport_warnings() as warned:
        for server_round in (1, 1, 1, 2, 3):  # one call per node
            transport.round_notice(server_round)
    assert [m.split(":")[0] for m in warned] == ["round 1", "round 2", "round 3"]
    with transport_warnings() as warned:
        ServerTransport.from_settings("127.0.0.1", insecure=True).round_notice(1)
    assert not warned
