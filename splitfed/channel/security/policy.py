"""How the split channel is secured: plaintext on loopback, TLS everywhere else, plaintext off loopback only on purpose.

The trunk server picks one of three modes from the run's settings (:func:`choose_mode`):

* ``tls``: the operator's own certificate (``tls-cert``/``tls-key``, optional ``tls-client-ca`` for mutual
  TLS); clients verify it with ``tls-root-ca`` (or the system roots).
* ``auto-tls``: the trunk is reachable from another machine (its bind or advertised host is not loopback)
  and no certificate is given. The server issues an ephemeral CA and certificate at start
  (:mod:`splitfed.channel.security.autotls`) and sends the CA certificate to every node in the round's Flower
  message; clients pin it.
* ``plaintext``: the trunk is bound to loopback and advertised on loopback (the bytes never leave the
  machine), or ``trunk-insecure = true``. Plaintext on a non-loopback bind or advertised address needs
  ``trunk-allow-plaintext-remote = true`` as well, and is logged as a warning every round.

``tls-client-ca`` (mutual TLS) asks for TLS: with it the trunk serves TLS even on loopback (its own certificate,
or an issued one) and refuses plaintext at start.

Clients apply the same rule from their side (:func:`client_credentials`): they pin the CA the server sent,
verify the operator's CA, or speak plaintext only to a loopback address unless the run allows otherwise; they
present their node's certificate (``tls-client-cert``/``tls-client-key``) when the run requires one.
This module imports gRPC only when credentials are built, so configuration checks stay light.
"""

from __future__ import annotations

import enum
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from splitfed.channel.security.autotls import (
    WILDCARD_HOSTS,
    IssuedTLS,
    is_loopback,
    issue,
    normalize_host,
    san_hosts,
)
from splitfed.channel.security.hosts import host_of
from splitfed.errors import ConfigError

if TYPE_CHECKING:
    import ssl

    import grpc

    from splitfed.channel.security.bulktls import BulkTLS

log = logging.getLogger(__name__)

#: File in the output folder that holds the ephemeral CA certificate (public material).
CA_FILE = "trunk-ca.pem"


class TransportMode(str, enum.Enum):
    """How the split channel is carried."""

    PLAINTEXT = "plaintext"
    TLS = "tls"  # the operator's own certificate
    AUTO_TLS = "auto-tls"  # an ephemeral CA issued at start, pinned by clients


def advertised_host(bind: str, advertise: str = "") -> str:
    """The host clients dial: ``advertise``'s host, else 127.0.0.1 for a wildcard bind, else the bound host."""
    if advertise:
        return host_of(advertise)
    return "127.0.0.1" if normalize_host(bind) in WILDCARD_HOSTS else normalize_host(bind)


def leaves_machine(bind: str, advertise: str = "") -> bool:
    """True when a server bound to ``bind`` (advertised as ``advertise``) can be reached from other machines: its
    plaintext would cross the network (the check behind ``trunk-allow-plaintext-remote`` and
    ``splitfed serve --allow-insecure-remote``)."""
    return not (is_loopback(bind) and is_loopback(advertised_host(bind, advertise)))


_leaves_machine = leaves_machine


def choose_mode(bind: str, *, advertise: str = "", insecure: bool = False, allow_plaintext_remote: bool = False,
                tls_cert: str = "", tls_key: str = "", tls_client_ca: str = "") -> TransportMode:
    """The split channel's mode for these settings (run-config keys ``trunk-*`` and ``tls-*``).

    Raises:
        ConfigError: only one of tls-cert/tls-key is set; trunk-insecure is combined with tls-cert/tls-key or
            with tls-client-ca; or plaintext was asked for on a non-loopback address without
            ``trunk-allow-plaintext-remote``.
    """
    if bool(tls_cert) != bool(tls_key):
        raise ConfigError("tls-cert and tls-key go together: set both to serve your own certificate, or neither "
                          "to let the trunk issue one")
    if tls_cert and insecure:
        raise ConfigError("trunk-insecure = true asks for plaintext, but tls-cert and tls-key are set: remove "
                          "trunk-insecure to serve TLS with your certificate, or remove tls-cert and tls-key")
    if tls_client_ca and insecure:
        raise ConfigError("trunk-insecure = true asks for plaintext, but tls-client-ca asks for mutual TLS: remove "
                          "trunk-insecure to require client certificates, or remove tls-client-ca")
    if tls_cert:
        return TransportMode.TLS
    if tls_client_ca:  # mutual TLS, with a certificate issued now (on loopback too)
        return TransportMode.AUTO_TLS
    remote = _leaves_machine(bind, advertise)
    if insecure and remote and not allow_plaintext_remote:
        where = advertise if advertise and not is_loopback(host_of(advertise)) else bind
        raise ConfigError(
            f"trunk-insecure = true would send activations, gradients and tokens in plaintext to {where!r}, "
            "which is not a loopback address. To get TLS, set trunk-insecure = false (the default; the trunk then "
            "issues its own certificate and every client pins it; no files needed), or set tls-cert and tls-key to "
            "use yours. To insist on plaintext, also set trunk-allow-plaintext-remote = true")
    if insecure or not remote:
        return TransportMode.PLAINTEXT
    return TransportMode.AUTO_TLS


class ServerTransport:
    """The trunk server's transport: its mode, gRPC credentials, and the CA certificate clients pin.

    Build with :meth:`from_settings`; in ``auto-tls`` mode the certificate is issued right then, for the
    advertised host and the bound one. Nothing secret is written anywhere: the server key stays in memory.
    """

    def __init__(self, mode: TransportMode, *, bind: str, advertise: str = "", issued: IssuedTLS | None = None,
                 tls_cert: str = "", tls_key: str = "", tls_client_ca: str = "") -> None:
        if (mode is TransportMode.AUTO_TLS) != (issued is not None):
            raise ValueError("an issued certificate goes with auto-tls mode, and only with it")
        self.mode = mode
        self.bind = bind
        self.advertise = advertise
        self.issued = issued
        self._own = (tls_cert, tls_key, tls_client_ca)
        self._warned_round: int | None = None

    @classmethod
    def from_settings(cls, bind: str, *, advertise: str = "", insecure: bool = False,
                      allow_plaintext_remote: bool = False, tls_cert: str = "", tls_key: str = "",
                      tls_client_ca: str = "", extra_hosts: tuple[str, ...] = ()) -> ServerTransport:
        """Choose the mode (:func:`choose_mode`) and, for ``auto-tls``, issue the certificate."""
        mode = choose_mode(bind, advertise=advertise, insecure=insecure, allow_plaintext_remote=allow_plaintext_remote,
                           tls_cert=tls_cert, tls_key=tls_key, tls_client_ca=tls_client_ca)
        issued = None
        if mode is TransportMode.AUTO_TLS:
            issued = issue(san_hosts(advertised_host(bind, advertise), bind, extra_hosts))
            log.info("split channel: TLS with an ephemeral certificate for %s (CA SHA-256 %s); clients pin the CA "
                     "sent in each round's message", ", ".join(issued.hosts), issued.fingerprint)
        elif mode is TransportMode.PLAINTEXT and _leaves_machine(bind, advertise):
            log.warning("split channel: PLAINTEXT on %s (trunk-allow-plaintext-remote = true): anyone on the network "
                        "can read activations, gradients and tokens", advertise or bind)
        return cls(mode, bind=bind, advertise=advertise, issued=issued, tls_cert=tls_cert, tls_key=tls_key,
                   tls_client_ca=tls_client_ca)

    @classmethod
    def from_config(cls, cfg: Any) -> ServerTransport:
        """From a :class:`~splitfed.config.RunConfig` (its ``trunk-*`` and ``tls-*`` keys)."""
        return cls.from_settings(cfg.trunk_bind, advertise=cfg.trunk_advertise, insecure=cfg.trunk_insecure,
                                 allow_plaintext_remote=getattr(cfg, "trunk_allow_plaintext_remote", False),
                                 tls_cert=cfg.tls_cert, tls_key=cfg.tls_key, tls_client_ca=cfg.tls_client_ca)

    @property
    def insecure(self) -> bool:
        """True when the channel is plaintext."""
        return self.mode is TransportMode.PLAINTEXT

    @property
    def ca_pem(self) -> str | None:
        """The ephemeral CA certificate (PEM text) clients must pin; None unless ``auto-tls``."""
        return None if self.issued is None else self.issued.ca_pem.decode("ascii")

    def credentials(self) -> grpc.ServerCredentials | None:
        """gRPC server credentials (None for plaintext)."""
        from splitfed.channel.security import credentials as security

        if self.mode is TransportMode.PLAINTEXT:
            return None
        cert, key, client_ca = self._own
        if self.issued is not None:
            return security.server_credentials_from_pem(self.issued.cert_pem, self.issued.server_key_pem,
                                                        client_ca or None)
        return security.server_credentials(cert, key, client_ca or None)

    def bulk_context(self) -> ssl.SSLContext | None:
        """TLS for the trunk server's bulk links, with the same certificate, key and client CA as
        :meth:`credentials` (None for plaintext: the links are plaintext too)."""
        from splitfed.channel.security.bulktls import server_context
        from splitfed.channel.security.credentials import _read

        if self.mode is TransportMode.PLAINTEXT:
            return None
        cert, key, client_ca = self._own
        ca_pem = _read(client_ca, "client CA certificate") if client_ca else None
        if self.issued is not None:
            return server_context(self.issued.cert_pem, self.issued.server_key_pem, ca_pem)
        return server_context(_read(cert, "server certificate chain"), _read(key, "server private key"), ca_pem)

    def write_ca(self, folder: str | Path) -> Path | None:
        """Write the ephemeral CA certificate (public) to ``folder/trunk-ca.pem`` for operators and health
        checks; removes a stale one when this run has none. Returns the path written, if any."""
        path = Path(folder) / CA_FILE
        if self.issued is None:
            path.unlink(missing_ok=True)
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".pem.tmp")
        tmp.write_bytes(self.issued.ca_pem)
        tmp.replace(path)
        return path

    def round_notice(self, server_round: int) -> None:
        """Once per round: warn when plaintext leaves this machine."""
        if self.mode is not TransportMode.PLAINTEXT or not _leaves_machine(self.bind, self.advertise):
            return
        if self._warned_round == server_round:
            return
        self._warned_round = server_round
        log.warning("round %d: the split channel is PLAINTEXT on a non-loopback address (%s): activations, "
                    "gradients and this round's tokens can be read and replayed on the network; remove "
                    "trunk-insecure and trunk-allow-plaintext-remote to get TLS", server_round,
                    self.advertise or self.bind)

    def describe(self) -> str:
        """One phrase for logs: the mode and, with an ephemeral CA, its fingerprint."""
        mutual = ", client certificates required" if self._own[2] else ""
        if self.issued is not None:
            return f"TLS, ephemeral CA {self.issued.fingerprint[:23]}...{mutual}"
        return {TransportMode.TLS: "TLS, operator's certificate" + mutual,
                TransportMode.PLAINTEXT: "plaintext"}[self.mode]


def client_credentials(address: str, *, pinned_ca: str | bytes | None = None, own_tls: bool = False,
                       root_ca: str = "", allow_plaintext_remote: bool = False, client_cert: str = "",
                       client_key: str = "", client_cert_required: bool = False) -> grpc.ChannelCredentials | None:
    """A client's credentials for the trunk at ``address``; None means plaintext.

    ``pinned_ca`` (sent by the server in ``auto-tls`` mode) becomes the only trust root. Otherwise, with
    ``own_tls`` (``tls-cert`` set for the run), the server is verified with ``root_ca`` or the system roots.
    Otherwise plaintext, which a client speaks to a loopback address only, unless ``allow_plaintext_remote``.
    Over TLS the client presents ``client_cert``/``client_key`` (its node's ``tls-client-cert``/``tls-client-key``)
    when given; ``client_cert_required`` (the run sets ``tls-client-ca``) makes them mandatory.

    Raises:
        ConfigError: plaintext to a non-loopback address without ``trunk-allow-plaintext-remote``; or the trunk
            requires a client certificate and this node has none (the message names the keys to set).
    """
    from splitfed.channel.security import credentials as security

    if bool(client_cert) != bool(client_key):
        raise ConfigError("tls-client-cert and tls-client-key go together: set both to this node's certificate "
                          "and private key, or neither")
    if client_cert_required and not client_cert:
        raise ConfigError(
            "the trunk requires a client certificate (the run sets tls-client-ca) and this node has none: set "
            "tls-client-cert and tls-client-key to this node's certificate and private key (PEM files, the "
            "certificate signed by the tls-client-ca CA), for every node in the run config, or per SuperNode with "
            "flower-supernode --node-config \"tls-client-cert='/path/node.pem' tls-client-key='/path/node.key'\"")
    pair = (client_cert, client_key) if client_cert else (None, None)
    if pinned_ca:
        return security.pinned_channel_credentials(pinned_ca, *pair)
    if own_tls or root_ca:
        return security.channel_credentials(root_ca or None, *pair)
    if not is_loopback(host_of(address)) and not allow_plaintext_remote:
        raise ConfigError(f"refusing plaintext to the trunk at {address}, which is not a loopback address, and the "
                          "server sent no CA certificate to pin: remove trunk-insecure so the trunk serves TLS, "
                          "or set trunk-allow-plaintext-remote = true to insist on plaintext")
    return None


def client_bulk_tls(*, pinned_ca: str | bytes | None = None, root_ca: str = "", client_cert: str = "",
                    client_key: str = "") -> BulkTLS:
    """A TLS client's bulk-link TLS, trusting what :func:`client_credentials` trusts (``pinned_ca``, else
    ``root_ca``, else the system's roots) and presenting the same client certificate."""
    from splitfed.channel.security.bulktls import BulkTLS
    from splitfed.channel.security.credentials import _read

    pair = {"client_cert": client_cert, "client_key": client_key} if client_cert else {}
    if pinned_ca:
        return BulkTLS.client(pinned_ca, **pair)
    return BulkTLS.client(_read(root_ca, "root CA certificate") if root_ca else None, **pair)


__all__ = ["CA_FILE", "ServerTransport", "TransportMode", "advertised_host", "choose_mode", "client_bulk_tls",
           "client_credentials", "host_of", "is_loopback", "leaves_machine"]
