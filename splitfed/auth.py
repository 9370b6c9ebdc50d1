"""Per-client tokens for the split channel: HMAC-SHA256 over run, node, round and expiry.

The ServerApp issues one token per sampled node and round inside the Flower
message (which Flower's own channel protects); the trunk server verifies it on
every call and identifies the caller as ``node-<id>``. A token is refused when
it is missing, malformed, signed with another key, for another run, expired,
or for a round older than the current one (a replay).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from splitfed.errors import AuthError

_SEP = "."


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
        header = metadata.get("authorization", "")
        if not header:
            raise AuthError("missing authorization metadata: send 'authorization: Bearer <token>'")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise AuthError("authorization metadata must be 'Bearer <token>'")
        return self.verify(token.strip()).client_id
