"""Host names and addresses: normalising them, and telling loopback from the rest (standard library only)."""

from __future__ import annotations

import ipaddress

#: Binds that listen on every interface.
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def normalize_host(host: str) -> str:
    """``host`` without IPv6 brackets and surrounding blanks, lower-cased."""
    return host.strip().strip("[]").lower()


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses; wildcard binds and other names are not loopback."""
    host = normalize_host(host)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_of(address: str) -> str:
    """The host of ``host:port`` (``[v6]:port`` too), without brackets and lower-cased."""
    address = address.strip()
    if address.startswith("["):
        return normalize_host(address[1:address.find("]")] if "]" in address else address)
    if address.count(":") == 1:
        return normalize_host(address.rsplit(":", 1)[0])
    return normalize_host(address)  # a bare host, or a bare IPv6 address
