"""``splitfed route``: one address in front of several trunk servers (nginx, or the Python router); and the router
of ``serve --replicas``."""

from __future__ import annotations

import argparse
import logging
import signal
from collections.abc import Callable, Sequence
from typing import Any

from splitfed.cli.lifetime import serve_until_signalled

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
    nginx = route.add_argument_group("the proxy", "--proxy nginx: nginx carries the calls (docs/replicas.md says what "
                                                  "only the Python router does)")
    nginx.add_argument("--proxy", choices=("python", "nginx"), default="python",
                       help="python: the Python router (default); nginx: write nginx's configuration from the servers' "
                            "models, check it and run nginx as a child process")
    nginx.add_argument("--model", action="append", default=[],
                       help="a model to ask the servers about (a server holding several names none by itself); repeat")
    nginx.add_argument("--proxy-dir", help="folder for nginx's configuration, error log and runtime files (default: a "
                                           "new temporary folder)")
    nginx.add_argument("--check", action="store_true",
                       help="write the configuration, check it with nginx -t, print it and exit")
    nginx.add_argument("--rediscover", type=float, default=5.0,
                       help="seconds between asking the servers again (nginx reloads when their models change; 0: never)")
    nginx.add_argument("--workers", default="auto", help="nginx worker processes (auto: one per core)")
    nginx.add_argument("--backend-tls-name", help="the name the servers' certificates are checked against (default: "
                                                  "the first --backend's host)")
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
    if args.proxy == "nginx":
        return _route_nginx(args)
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
    return serve_until_signalled(router.wait, router.stop)


def _route_nginx(args: argparse.Namespace) -> int:
    """``--proxy nginx``: discover the servers' models, write and check nginx's configuration, run nginx."""
    import os
    import tempfile
    import threading
    import time
    from pathlib import Path

    from splitfed.channel.security.tokens import TOKEN_ENV, load_token_file
    from splitfed.channel.security.hosts import host_of, is_loopback
    from splitfed.channel.routing.discovery import discover
    from splitfed.channel.routing.nginx import NginxProxy, NginxSettings
    from splitfed.channel.security.credentials import channel_credentials
    from splitfed.errors import ConfigError

    refused = [flag for flag, given in (("--backend-token-file", args.backend_token_file),
                                        ("--backend ADDR=METRICS_URL", any(m for _, m in args.backend))) if given]
    if refused:
        raise SystemExit(f"{', '.join(refused)}: the Python router only (--proxy python); nginx neither swaps tokens "
                         "nor reads the servers' memory")
    addresses = [a for a, _ in args.backend]
    if not args.backend_ca and not args.backend_insecure:
        remote = [a for a in addresses if not is_loopback(host_of(a))]
        if remote:
            raise SystemExit(f"backends {', '.join(remote)} are not on loopback: give --backend-ca (TLS) or "
                             "--backend-insecure (plaintext on a trusted network)")
    token = load_token_file(args.token_file, create=True) if args.token_file else \
        (os.environ.get(TOKEN_ENV, "").strip() or None)
    backend_credentials = channel_credentials(args.backend_ca) if args.backend_ca else None
    try:
        settings = NginxSettings(host=args.host, port=args.port, tls_cert=None if args.insecure else args.tls_cert,
                                 tls_key=None if args.insecure else args.tls_key,
                                 tls_client_ca=None if args.insecure else args.tls_client_ca,
                                 backend_ca=args.backend_ca, backend_tls_name=args.backend_tls_name,
                                 token=token, workers=args.workers)
        found = discover(addresses, args.model, credentials=backend_credentials)
        directory = Path(args.proxy_dir or tempfile.mkdtemp(prefix="splitfed-nginx-"))
        proxy = NginxProxy(settings, found, directory)
        if args.check:
            conf = proxy.write()
            print(conf.read_text(), end="")
            print(f"# {conf}: nginx -t accepts it")
            return 0
        proxy.start()
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    log.info("nginx's configuration and error log: %s", directory)
    stopping = threading.Event()

    def stop(*_: object) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    next_look = time.monotonic() + args.rediscover
    try:
        while not stopping.is_set():
            code = proxy.wait(timeout=0.2)
            if code is not None and not stopping.is_set():
                log.error("nginx exited with status %d; see %s", code, directory / "error.log")
                return code or 1
            if args.rediscover > 0 and time.monotonic() >= next_look:
                next_look = time.monotonic() + args.rediscover
                try:
                    proxy.update(discover(addresses, args.model, credentials=backend_credentials))
                except ConfigError as exc:
                    log.warning("nginx keeps its configuration: %s", exc)
    finally:
        proxy.stop()
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
