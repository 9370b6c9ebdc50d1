"""TLS from a router to trunk servers that present a certificate the router itself was given."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
from cryptography import x509

from splitfed.errors import ConfigError


def certificate_host(cert_chain: bytes) -> str:
    """The first host the chain's leaf certificate covers (a DNS name or an IP address of its SAN, else its CN)."""
    try:
        leaf = x509.load_pem_x509_certificate(cert_chain)
    except ValueError as exc:
        raise ConfigError(f"the TLS certificate chain is not PEM: {exc}") from None
    try:
        san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = [str(n) for n in san.get_values_for_type(x509.DNSName)] + \
            [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
    except x509.ExtensionNotFound:
        names = []
    if not names:
        names = [str(a.value) for a in leaf.subject.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)]
    if not names:
        raise ConfigError("the TLS certificate names no host (no subject alternative name, no common name)")
    return names[0]


def backend_tls(cert_chain: str | Path, private_key: str | Path | None = None,
                ca: str | Path | None = None) -> tuple[grpc.ChannelCredentials, list[tuple[str, Any]]]:
    """Credentials and channel options to reach trunk servers serving ``cert_chain`` (on any address).

    The router verifies them with ``ca``, else with the chain itself (a self-signed certificate, or a chain
    that ends with its CA), under the first host the certificate names. With ``private_key`` it presents the
    same certificate as its own client certificate (servers that require mutual TLS).
    """
    try:
        chain = Path(cert_chain).expanduser().read_bytes()
        roots = chain if ca is None else Path(ca).expanduser().read_bytes()
        key = None if private_key is None else Path(private_key).expanduser().read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read a TLS file for the router: {exc}") from None
    credentials = grpc.ssl_channel_credentials(root_certificates=roots, private_key=key,
                                               certificate_chain=chain if key is not None else None)
    return credentials, [("grpc.ssl_target_name_override", certificate_host(chain))]
