"""TLS credentials for the split channel (server, client, and mutual TLS)."""

from __future__ import annotations

from pathlib import Path

import grpc

from splitfed.errors import ConfigError


def _read(path: str | Path, what: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} at {path}: {exc.strerror}") from None


def server_credentials(cert_chain: str | Path, private_key: str | Path,
                       client_ca: str | Path | None = None) -> grpc.ServerCredentials:
    """Server TLS from PEM files; with ``client_ca``, clients must present a certificate it signed (mTLS)."""
    pair = [(_read(private_key, "server private key"), _read(cert_chain, "server certificate chain"))]
    if client_ca is None:
        return grpc.ssl_server_credentials(pair)
    return grpc.ssl_server_credentials(pair, root_certificates=_read(client_ca, "client CA certificate"),
                                       require_client_auth=True)


def channel_credentials(root_ca: str | Path | None = None, client_cert: str | Path | None = None,
                        client_key: str | Path | None = None) -> grpc.ChannelCredentials:
    """Client TLS: verify the server with ``root_ca`` (system roots when None); present a certificate for mTLS."""
    if (client_cert is None) != (client_key is None):
        raise ConfigError("mutual TLS needs both a client certificate and its private key")
    return grpc.ssl_channel_credentials(
        root_certificates=None if root_ca is None else _read(root_ca, "root CA certificate"),
        private_key=None if client_key is None else _read(client_key, "client private key"),
        certificate_chain=None if client_cert is None else _read(client_cert, "client certificate"))
