"""TLS for bulk links: the tensor bytes beside a TLS gRPC channel, encrypted and the server authenticated alike.

A TLS bulk link is Python's :mod:`ssl` over each of its TCP connections, with the same certificate and key as the
gRPC server and, on the client, the same trust root as its channel (an operator's CA, the system's roots, or the
zero-configuration CA the run pinned). The server's certificate is verified against the host the client dials;
a client certificate is asked for where the gRPC server asks for one (mutual TLS). The one-time ticket that
attaches a connection to its link then travels encrypted.

An SSL connection must not read and write from two threads at once (OpenSSL's objects are not made for it), so a
TLS link carries each direction on connections of its own: ``n`` from the client to the server and ``n`` back
(:func:`split_directions`), where a plaintext link uses each of its ``n`` connections both ways.
"""

from __future__ import annotations

import os
import ssl
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from splitfed.errors import ConfigError

T = TypeVar("T")


def _is_pem_certificate(data: bytes) -> bool:
    return b"-----BEGIN CERTIFICATE-----" in data


def server_context(cert_chain_pem: bytes, private_key_pem: bytes, client_ca_pem: bytes | None = None
                   ) -> ssl.SSLContext:
    """The server's TLS for its bulk links from PEM bytes (the gRPC server's own); with ``client_ca_pem``,
    connections must present a certificate it signed. Raises :class:`ConfigError` for PEM that does not load."""
    if not _is_pem_certificate(cert_chain_pem):
        raise ConfigError("the bulk links' certificate chain is not PEM; pass the gRPC server's certificate chain")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # ssl loads a key from a file only: a directory only this user can enter, removed at once.
    with tempfile.TemporaryDirectory(prefix="splitfed-bulk-tls-") as folder:
        cert, key = Path(folder) / "chain.pem", Path(folder) / "key.pem"
        for path, data in ((cert, cert_chain_pem), (key, private_key_pem)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
        try:
            ctx.load_cert_chain(cert, key)
        except ssl.SSLError as exc:
            raise ConfigError(f"the bulk links' certificate and key do not load ({exc.reason or exc}); pass the "
                              "gRPC server's PEM certificate chain and its private key") from None
    if client_ca_pem is not None:
        ctx.load_verify_locations(cadata=client_ca_pem.decode("ascii"))
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


@dataclass(frozen=True)
class BulkTLS:
    """A client's TLS for its bulk links: the context its connections are wrapped with, and the name the server's
    certificate must carry (None: the host the client dials). Build it with :meth:`client`."""

    context: ssl.SSLContext
    server_name: str | None = None

    @classmethod
    def client(cls, ca_pem: bytes | str | None = None, *, server_name: str | None = None,
               client_cert: str | Path | None = None, client_key: str | Path | None = None) -> BulkTLS:
        """Trust ``ca_pem`` only (the CA that signed the server's certificate, as the gRPC channel does), or the
        system's roots when None; present ``client_cert``/``client_key`` (PEM files) where the server asks for a
        client certificate."""
        if (client_cert is None) != (client_key is None):
            raise ConfigError("mutual TLS needs both a client certificate and its private key")
        data = ca_pem.encode("ascii") if isinstance(ca_pem, str) else ca_pem
        if data is not None and not _is_pem_certificate(data):
            raise ConfigError("the CA certificate for bulk links is not PEM; pass the gRPC channel's root "
                              "certificate (PEM)")
        ctx = ssl.create_default_context(cadata=None if data is None else data.decode("ascii"))
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if client_cert is not None:
            try:
                ctx.load_cert_chain(client_cert, client_key)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"cannot load the client certificate {client_cert} and key {client_key}: "
                                  f"{exc}") from None
        return cls(ctx, server_name)


def split_directions(socks: Sequence[T], tls: bool, server: bool) -> tuple[list[T], list[T]]:
    """A link's connections as ``(read from, written to)`` by one end: a plaintext link reads and writes all of
    them; a TLS link's first half carries the client's bytes, its second half the server's."""
    if not tls:
        return list(socks), list(socks)
    half = len(socks) // 2
    up, down = list(socks[:half]), list(socks[half:])
    return (up, down) if server else (down, up)


__all__ = ["BulkTLS", "server_context", "split_directions"]
