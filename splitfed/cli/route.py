"""``splitfed route``: one address in front of several trunk servers; and the router of ``serve --replicas``."""

from __future__ import annotations

import argparse
import logging
import signal
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("splitfed")


def _backend(text: str) -> tuple[str, str | None]:
    """``HOST:PORT`` or ``HOST:PORT=METRICS_URL``."""
    address, _, metrics = text.partition("=")
    if ":" not in address:
        raise argparse.ArgumentTypeError(f"--backend must be HOST:PORT[=METRICS_URL], got {text!r}")
    return address, metrics or None


def add_parser(sub: Any) -> None:
    """Register ``splitfed route`` on the CLI's subparsers."""
    route = sub.add_parser("route", help="one address in front of several trunk servers (sticky per client, by "
                                         "load, by model)")
    route.add_argument("--backend", type=_backend, action="append", required=True,
                       help="a trunk server, HOST:PORT, optionally =http://HOST:PORT/metrics (its Prometheus "
                            "endpoint: its memory breaks load ties); repeat for each")
    route.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all interfaces)")
    route.add_argument("--port", type=int, default=50051)
    route.add_argument("--insecure", action="store_true", help="serve plaintext (loopback and tests only; elsewhere "
                                                               "also --allow-insecure-remote)")
    route.add_argument("--tls-cert", help="the router's certificate chain (PEM)")
    route.add_argument("--tls-key", help="the router's private key (PEM)")
    route.add_argument("--tls-client-ca", help="CA that signs client certificates: require mutual TLS")
    from splitfed.cli.security import add_security_options

    add_security_options(route)
    route.add_argument("--backend-token-file", help="file holding the token the backends require, sent in place of "
                                                    "the client's (default: the client's token passes through)")
    route.add_argument("--backend-ca", help="CA that signs the trunk servers' certificates: reach them over TLS "
                                            "(default: plaintext, which only loopback backends accept)")
    route.add_argument("--backend-insecure", action="store_true",
                       help="reach backends that are not on loopback in plaintext (trusted networks only)")
    route.add_argument("--probe-interval", type=float, default=1.0, help="seconds between health checks of a backend")
    route.add_argument("--sticky-idle", type=float, default=600.0,
                       help="seconds without a call after which a client is placed by load again")
    route.set_defaults(func=_route)


def _server_credentials(args: argparse.Namespace) -> Any:
    if args.insecure:
        return None
    if not (args.tls_cert and args.tls_key):
        raise SystemExit("give --tls-cert and --tls-key (and --tls-client-ca for mutual TLS), or --insecure to "
                         "serve plaintext")
    from splitfed.channel.security.credentials import server_credentials

    return server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)


def _route(args: argparse.Namespace) -> int:
    from splitfed.channel.security.hosts import host_of, is_loopback
    from splitfed.channel.routing import Router
    from splitfed.channel.security.credentials import channel_credentials

    from splitfed.channel.security.tokens import load_token_file
    from splitfed.cli.security import server_security

    authenticate = server_security(args)  # TLS flags, plaintext off loopback, the clients' token
    credentials = _server_credentials(args)
    backend_token = load_token_file(args.backend_token_file) if args.backend_token_file else None
    addresses = [a for a, _ in args.backend]
    backend_credentials = None
    if args.backend_ca:
        backend_credentials = channel_credentials(args.backend_ca)
    elif not args.backend_insecure:
        remote = [a for a in addresses if not is_loopback(host_of(a))]
        if remote:
            raise SystemExit(f"backends {', '.join(remote)} are not on loopback: give --backend-ca (TLS) or "
                             "--backend-insecure (plaintext on a trusted network)")
    router = Router(addresses, host=args.host, port=args.port, insecure=credentials is None, credentials=credentials,
                    backend_credentials=backend_credentials, metrics={a: m for a, m in args.backend if m},
                    probe_interval_s=args.probe_interval, sticky_idle_s=args.sticky_idle, authenticate=authenticate,
                    backend_token=backend_token).start()
    return _serve_until_stopped(router)


def _serve_until_stopped(router: Any, stop_also: Sequence[Any] = ()) -> int:
    def stop(*_: object) -> None:
        router.stop()
        for other in stop_also:
            other.stop()

    signal.signal(signal.SIGTERM, lambda *_: stop())
    try:
        router.wait()
    except KeyboardInterrupt:
        stop()
    return 0


def replica_router(args: argparse.Namespace, addresses: Sequence[str],
                   gone: Callable[[int], bool] | None = None) -> Any:
    """The router of ``splitfed serve --replicas N`` on ``--port``, in front of the replicas' addresses (not
    started). With TLS it serves the replicas' certificate and reaches them over TLS, trusting that certificate's
    chain (which must hold its CA, or be self-signed) and presenting it as its client certificate when they
    require one (``--tls-client-ca``). ``gone(rank)``: whether the replica set already reported that replica's
    end (the router then notes it going down at INFO)."""
    from splitfed.channel.routing import Router
    from splitfed.channel.routing.tls import backend_tls
    from splitfed.run.launcher import advertised

    credentials = _server_credentials(args)
    backend_credentials, options = None, []
    if credentials is not None:
        backend_credentials, options = backend_tls(args.tls_cert, args.tls_key if args.tls_client_ca else None)
    dial = [advertised("", 0, a) for a in addresses]  # a wildcard bind is dialled on loopback
    return Router(dial, host=args.host, port=args.port, insecure=credentials is None, credentials=credentials,
                  backend_credentials=backend_credentials, backend_options=options,
                  authenticate=getattr(args, "authenticate", None),  # the replicas check the same token again
                  expected_down=gone)
