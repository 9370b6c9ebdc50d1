"""What an UNAVAILABLE call means for the one who made it: no server there, or a server that said why.

A split-channel or admin call answered UNAVAILABLE either never reached a server (nothing listens at the
address, or its host name does not resolve: gRPC's own details say so), or reached one that refused it for a
while (a model loading, being unloaded, the server shutting down: its details say what happened and when to
retry). Only the first gets a hint to start a server; the second is told as the server told it.
"""

from __future__ import annotations

#: gRPC's details of a call that found no server at the address (connection refused, nothing routable).
_NO_SERVER = ("failed to connect to all addresses", "connection refused", "connect failed")
#: gRPC's details of an address whose host name did not resolve.
_NO_HOST = ("errors resolving", "dns resolution failed", "name resolution")
#: gRPC's details of a server that answered, but not the TLS the client expected (plaintext, another CA).
_TLS = ("handshake failed", "ssl_error", "certificate verify failed")
#: gRPC's details of a connection lost during the call (the server stopped or restarted under it).
_LOST = ("socket closed", "connection reset", "broken pipe", "goaway", "stream removed")


def unavailable_hint(address: str, details: str | None, *, admin: bool = False) -> str:
    """The hint appended to an UNAVAILABLE error of a call to ``address`` with gRPC ``details`` ("" for a reply
    of a running server, whose details already say what happened)."""
    text = (details or "").lower()
    if any(s in text for s in _NO_HOST):
        return f" (the host of {address} does not resolve: check the address)"
    if any(s in text for s in _TLS):
        return (f" (a server answers at {address}, but the TLS handshake failed: it serves plaintext (then connect "
                "with --insecure, on loopback only) or a certificate that the CA given (--tls-ca) does not sign)")
    if any(s in text for s in _NO_SERVER):
        start = ("`splitfed serve --model ... --port ... --admin-token-file F`" if admin else
                 "`splitfed serve --model ... --port ...` or TrunkServer(...).start()")
        return f" (is a trunk server running at {address}? Start one with {start}, and check the host and port)"
    if any(s in text for s in _LOST):
        return f" (the connection to {address} was lost during the call: the server stopped or restarted; retry)"
    return ""
