"""TLS credentials for the split channel (server, client, mutual TLS, and pinned zero-configuration CAs)."""

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


def server_credentials_from_pem(cert_chain_pem: bytes, private_key_pem: bytes,
                                client_ca: str | Path | None = None) -> grpc.ServerCredentials:
    """Server TLS from PEM bytes held in memory (the zero-configuration certificate; see ``autotls``); with
    ``client_ca``, clients must present a certificate it signed (mTLS)."""
    pair = [(private_key_pem, cert_chain_pem)]
    if client_ca is None:
        return grpc.ssl_server_credentials(pair)
    return grpc.ssl_server_credentials(pair, root_certificates=_read(client_ca, "client CA certificate"),
                                       require_client_auth=True)


def pinned_channel_credentials(ca_pem: str | bytes, client_cert: str | Path | None = None,
                               client_key: str | Path | None = None) -> grpc.ChannelCredentials:
    """Client TLS that trusts ``ca_pem`` only (the CA certificate the trunk sent in the round's message);
    presents ``client_cert`` (with ``client_key``) for mTLS."""
    data = ca_pem.encode("ascii") if isinstance(ca_pem, str) else bytes(ca_pem)
    if b"-----BEGIN CERTIFICATE-----" not in data:
        raise ConfigError("the trunk CA certificate sent with the round is not PEM; update the ServerApp and "
                          "ClientApp to the same splitfed version")
    if (client_cert is None) != (client_key is None):
        raise ConfigError("mutual TLS needs both a client certificate and its private key")
    return grpc.ssl_channel_credentials(
        root_certificates=data, private_key=None if client_key is None else _read(client_key, "client private key"),
        certificate_chain=None if client_cert is None else _read(client_cert, "client certificate"))
