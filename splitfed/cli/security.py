"""Who may reach a standalone trunk (``splitfed serve``) or router (``splitfed route``), and over what.

Two rules, checked before anything heavy loads:

* Plaintext (``--insecure``) on an address other machines can reach is refused unless
  ``--allow-insecure-remote`` says the operator means it, and then logged as one WARNING. The test of
  "other machines can reach it" is the one the Flower app's ``trunk-allow-plaintext-remote`` uses
  (:func:`splitfed.channel.security.policy.leaves_machine`).
* Off loopback, callers must prove who they are: a client certificate (``--tls-client-ca``, mutual TLS) or
  the static bearer token (``--token-file F`` or ``$SPLITFED_TOKEN``; :class:`splitfed.channel.security.tokens.StaticToken`).
  On loopback a token is checked when one is given. A ``--token-file`` that does not exist is created with a
  fresh token (mode 0600).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Mapping

from splitfed.channel.security.tokens import TOKEN_ENV, StaticToken, load_token_file
from splitfed.errors import AuthError

log = logging.getLogger("splitfed")


def add_security_options(parser: argparse.ArgumentParser) -> None:
    """``--allow-insecure-remote`` and ``--token-file`` (for ``serve`` and ``route``)."""
    parser.add_argument("--allow-insecure-remote", action="store_true",
                        help="with --insecure on a non-loopback --host: serve plaintext anyway (anyone on the network "
                             "can read and alter activations, gradients and the token; trusted networks only)")
    parser.add_argument("--token-file",
                        help=f"file holding the token clients must send (also ${TOKEN_ENV}); required off loopback "
                             "unless --tls-client-ca; a missing file is created with a fresh token (mode 0600)")


def check_plaintext(args: argparse.Namespace) -> bool:
    """Refuse ``--insecure`` off loopback without ``--allow-insecure-remote``; True when plaintext is allowed there
    (the caller warns once it has checked everything else)."""
    from splitfed.channel.security.policy import leaves_machine

    if not args.insecure or not leaves_machine(args.host):
        return False
    if not args.allow_insecure_remote:
        raise SystemExit(f"--insecure would serve plaintext on {args.host}, which other machines can reach: give "
                         "--tls-cert and --tls-key for TLS, bind --host 127.0.0.1, or add --allow-insecure-remote "
                         "to insist on plaintext")
    return True


def warn_plaintext(args: argparse.Namespace) -> None:
    """The one WARNING of plaintext served off loopback."""
    log.warning("serving PLAINTEXT on %s (--insecure --allow-insecure-remote): anyone on the network can read and "
                "alter activations, gradients and the client token; proceed only on a network you trust", args.host)


def client_check(args: argparse.Namespace) -> Callable[[Mapping[str, str]], str] | None:
    """The server's ``authenticate`` hook for the clients' token, or None when callers are not asked for one.

    Raises:
        SystemExit: off loopback with neither a client CA (mutual TLS) nor a token; or the token is unusable.
    """
    from splitfed.channel.security.policy import leaves_machine

    mutual = bool(args.tls_client_ca) and not args.insecure
    try:
        if args.token_file:
            token = load_token_file(args.token_file, create=True)
        else:
            token = os.environ.get(TOKEN_ENV, "").strip() or None
        check = None if token is None else StaticToken(token)
    except (AuthError, ValueError) as exc:
        raise SystemExit(f"{exc} (${TOKEN_ENV} or --token-file)") from None
    if check is None and leaves_machine(args.host) and not mutual:
        raise SystemExit(f"on {args.host}, which other machines can reach, clients must authenticate: give "
                         f"--token-file F (created with a fresh token if missing) or ${TOKEN_ENV}, or "
                         "--tls-client-ca for client certificates (mutual TLS)")
    return None if check is None else check.authenticate


def server_security(args: argparse.Namespace) -> Callable[[Mapping[str, str]], str] | None:
    """Both rules for ``serve``/``route``: the TLS flags, plaintext off loopback, and the clients' check."""
    if not args.insecure and not (args.tls_cert and args.tls_key):
        raise SystemExit("give --tls-cert and --tls-key (and --tls-client-ca for mutual TLS), or --insecure to "
                         "serve plaintext")
    remote_plaintext = check_plaintext(args)
    check = client_check(args)
    if remote_plaintext:
        warn_plaintext(args)
    return check
