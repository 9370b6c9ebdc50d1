"""Client tokens for the split channel: per-round HMAC tokens for Flower runs, a static secret for ``splitfed serve``.

The ServerApp issues one token per sampled node and round inside the Flower
message (which Flower's own channel protects); the trunk server verifies it on
every call and identifies the caller as ``node-<id>``. A token is refused when
it is missing, malformed, signed with another key, for another run, expired,
or for a round older than the current one (a replay).

A standalone trunk (``splitfed serve``, ``splitfed route``) has no Flower message
to carry per-round tokens: it checks one static bearer secret
(:class:`StaticToken`, compared in constant time) that its operator hands to
every client (``--token-file``, ``$SPLITFED_TOKEN``). Both checks read the same
``authorization: Bearer <token>`` metadata and plug into the trunk server's
``authenticate`` hook.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from splitfed.errors import AuthError

_SEP = "."
#: Environment variable holding the static token of ``splitfed serve`` / ``route`` (and of their clients).
TOKEN_ENV = "SPLITFED_TOKEN"
#: The shortest static token accepted.
MIN_TOKEN_CHARS = 16
#: Metadata key of a client's self-declared id (as :data:`splitfed.channel.wire.limits.CLIENT_ID_KEY`).
_CLIENT_ID_KEY = "x-splitfed-client"

log = logging.getLogger(__name__)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class Claims:
    """What a token says."""

    run: str
    node: int
    round: int
    expires: float

    @property
    def client_id(self) -> str:
        """The client's identity on the trunk server."""
        return f"node-{self.node}"


class TokenIssuer:
    """Signs and verifies tokens with one secret (the ServerApp holds it; it never leaves the server).

    Args:
        run: the run's id; tokens of other runs are refused.
        secret: 32+ random bytes (default: fresh for this process).
        ttl_s: how long a token stays valid.
        clock: time source (tests inject one).
    """

    def __init__(self, run: str, secret: bytes | None = None, ttl_s: float = 3600.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.run = str(run)
        self._secret = secret or secrets.token_bytes(32)
        if len(self._secret) < 16:
            raise ValueError("the token secret must be at least 16 bytes")
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self.current_round = 0

    def _sign(self, payload: bytes) -> str:
        return _b64(hmac.new(self._secret, payload, hashlib.sha256).digest())

    def issue(self, node: int, server_round: int) -> str:
        """A token for ``node`` in ``server_round``; also marks that round as current."""
        with self._lock:
            self.current_round = max(self.current_round, int(server_round))
        claims = {"run": self.run, "node": int(node), "round": int(server_round),
                  "exp": round(self._clock() + self.ttl_s, 3)}
        payload = json.dumps(claims, separators=(",", ":"), sort_keys=True).encode()
        return _b64(payload) + _SEP + self._sign(payload)

    def verify(self, token: str) -> Claims:
        """The token's claims, or :class:`AuthError` saying why it is refused."""
        if not token or token.count(_SEP) != 1 or len(token) > 4096:
            raise AuthError("malformed token: expected '<payload>.<signature>'; use the token from this round's "
                            "Flower message")
        body, signature = token.split(_SEP)
        try:
            payload = _unb64(body)
        except (ValueError, TypeError):
            raise AuthError("malformed token: payload is not base64url") from None
        if not hmac.compare_digest(self._sign(payload), signature):
            raise AuthError("token signature does not match: it was not issued by this server")
        try:
            raw = json.loads(payload)
            claims = Claims(str(raw["run"]), int(raw["node"]), int(raw["round"]), float(raw["exp"]))
        except (ValueError, KeyError, TypeError):
            raise AuthError("malformed token claims") from None
        if claims.run != self.run:
            raise AuthError(f"token is for run {claims.run}, not this run ({self.run})")
        if claims.expires < self._clock():
            raise AuthError("token expired; the next round's message carries a fresh one")
        if claims.round < self.current_round:
            raise AuthError(f"token is for round {claims.round}, but round {self.current_round} is under way "
                            "(replayed token)")
        return claims

    def authenticate(self, metadata: Mapping[str, str]) -> str:
        """Check gRPC call metadata (``authorization: Bearer <token>``); returns the client id."""
        return self.verify(bearer(metadata)).client_id


def bearer(metadata: Mapping[str, str]) -> str:
    """The token of ``authorization: Bearer <token>`` call metadata, or :class:`AuthError` saying what is wrong."""
    header = metadata.get("authorization", "")
    if not header:
        raise AuthError("missing authorization metadata: send 'authorization: Bearer <token>'")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthError("authorization metadata must be 'Bearer <token>'")
    return token.strip()


class StaticToken:
    """One bearer secret shared by a standalone trunk's clients, compared in constant time.

    A shared secret says a caller may use the trunk, not who it is: the client id is the caller's own
    ``x-splitfed-client`` metadata (as on a server without tokens), prefixed so it never collides with a run
    token's ``node-<id>``.
    """

    def __init__(self, token: str) -> None:
        token = token.strip()
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"a client token needs at least {MIN_TOKEN_CHARS} characters")
        self._token = token.encode()

    def authenticate(self, metadata: Mapping[str, str]) -> str:
        """Check gRPC call metadata; returns the client id, or raises :class:`AuthError` (UNAUTHENTICATED)."""
        token = bearer(metadata)
        if not hmac.compare_digest(token.encode(), self._token):
            raise AuthError("wrong token: this trunk server takes the token its operator gave you (--token-file F "
                            f"or ${TOKEN_ENV})")
        return "token-" + (metadata.get(_CLIENT_ID_KEY) or "client")


def load_token_file(path: str | Path, *, create: bool = False) -> str:
    """The static token held in ``path``. With ``create`` and no such file, a fresh one is written there first
    (mode 0600, never overwriting) and its path logged: hand the file to the clients.

    Raises:
        AuthError: the file cannot be read, or holds fewer than 16 characters.
    """
    path = Path(path).expanduser()
    if create:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        except OSError as exc:
            raise AuthError(f"cannot create the token file {path}: {exc.strerror}") from None
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")
            log.warning("wrote a new client token to %s (mode 0600): give it to the clients (--token-file or $%s)",
                        path, TOKEN_ENV)
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise AuthError(f"cannot read the token file {path}: {exc.strerror}") from None
    if len(token) < MIN_TOKEN_CHARS:
        raise AuthError(f"the token in {path} has {len(token)} characters; use at least {MIN_TOKEN_CHARS} "
                        "(delete the file to have serve write a fresh one)")
    return token
