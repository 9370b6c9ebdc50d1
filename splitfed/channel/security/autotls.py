"""Zero-configuration TLS: an ephemeral CA and a server certificate issued when the trunk server starts.

Nothing here needs a PKI. :func:`issue` creates a fresh P-256 CA, signs one server certificate
whose subject alternative names cover the hosts the trunk is reached at, and forgets the CA's
private key at once, so nothing else can ever be signed by that CA. The server's private key
lives in memory only (never on disk). The CA certificate is public: the ServerApp sends it to
every node inside the round's Flower message (which Flower's own channel protects), and each
client pins it as its only trust root for the split channel. A restarted ServerApp issues a new
pair and sends the new CA with the next round.

The validity window is not what protects a run: a client trusts the CA only for the message that
carried it, and the key dies with the process. It is kept long (``DEFAULT_VALIDITY``) so that a
long run never fails a handshake, and starts an hour early to tolerate clock skew between machines.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from splitfed.channel.security.hosts import LOOPBACK_NAMES, WILDCARD_HOSTS, is_loopback, normalize_host
log = logging.getLogger(__name__)

#: How long an issued certificate stays valid (see the module docstring for why this is long).
DEFAULT_VALIDITY = datetime.timedelta(days=365)
#: Accepted clock skew: certificates are valid from this long before they are issued.
CLOCK_SKEW = datetime.timedelta(hours=1)
#: Binds that listen on every interface; they name no host a certificate could cover.


@dataclass(frozen=True)
class IssuedTLS:
    """An ephemeral CA certificate and the server certificate and key it signed (all PEM).

    ``server_key_pem`` is the only secret; it is held in memory and excluded from ``repr``.
    """

    ca_pem: bytes
    cert_pem: bytes
    server_key_pem: bytes = field(repr=False)
    hosts: tuple[str, ...]
    not_before: datetime.datetime
    not_after: datetime.datetime

    @property
    def fingerprint(self) -> str:
        """SHA-256 fingerprint of the CA certificate (hex, colon-separated), for logs and operators."""
        digest = x509.load_pem_x509_certificate(self.ca_pem).fingerprint(hashes.SHA256())
        return ":".join(f"{b:02X}" for b in digest)


def san_hosts(advertised: str, bound: str, extra: Iterable[str] = ()) -> tuple[str, ...]:
    """The names a trunk certificate must cover: the advertised host, the bound host and ``extra``.

    A wildcard bind (``0.0.0.0``, ``::``) listens on every interface, loopback included, so it adds
    the loopback names and this machine's host name; a loopback bind adds the loopback names.
    Order is kept, duplicates dropped.
    """
    names: list[str] = []
    bound_host = normalize_host(bound)
    candidates = [normalize_host(advertised)]
    if bound_host in WILDCARD_HOSTS:
        candidates += [*LOOPBACK_NAMES, normalize_host(socket.gethostname())]
    else:
        candidates.append(bound_host)
        if is_loopback(bound_host):
            candidates += list(LOOPBACK_NAMES)
    candidates += [normalize_host(h) for h in extra]
    for host in candidates:
        if host and host not in WILDCARD_HOSTS and host not in names:
            names.append(host)
    return tuple(names)


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def issue(hosts: Iterable[str], *, validity: datetime.timedelta = DEFAULT_VALIDITY,
          common_name: str = "splitfed trunk") -> IssuedTLS:
    """Create an ephemeral CA and a server certificate for ``hosts`` (IP addresses or DNS names).

    The CA may sign server certificates only (path length 0, key usage certificate and CRL signing);
    the server certificate is for TLS server authentication only. The CA's private key is dropped
    before this returns.

    Raises:
        ValueError: ``hosts`` names nothing a certificate can cover, or ``validity`` is not positive.
    """
    names = tuple(dict.fromkeys(normalize_host(h) for h in hosts if normalize_host(h) not in WILDCARD_HOSTS))
    if not names:
        raise ValueError("a trunk certificate needs at least one host name or IP address to cover")
    if validity <= datetime.timedelta(0):
        raise ValueError(f"validity must be positive, got {validity}")
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    not_before, not_after = now - CLOCK_SKEW, now + validity

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "splitfed"),
                         x509.NameAttribute(NameOID.COMMON_NAME, f"{common_name} ephemeral CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(not_before).not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "splitfed"),
                                 x509.NameAttribute(NameOID.COMMON_NAME, names[0][:64])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(not_before).not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName([_general_name(h) for h in names]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(server_key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    del ca_key  # nothing else is ever signed by this CA
    key_pem = server_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption())
    issued = IssuedTLS(ca_pem=_pem(ca_cert), cert_pem=_pem(server_cert), server_key_pem=key_pem, hosts=names,
                       not_before=not_before, not_after=not_after)
    log.debug("issued an ephemeral trunk certificate for %s (CA %s)", ", ".join(names), issued.fingerprint)
    return issued


__all__ = ["CLOCK_SKEW", "DEFAULT_VALIDITY", "LOOPBACK_NAMES", "WILDCARD_HOSTS", "IssuedTLS", "is_loopback", "issue",
           "normalize_host", "san_hosts"]
