"""Keys of the records the ServerApp adds to each message and the ClientApp reads."""

from __future__ import annotations

#: Keys of the per-node "splitfed" ConfigRecord the ServerApp adds to each message.
TRUNK_ADDRESS, TRUNK_TOKEN, SERVER_ROUND = "trunk-address", "trunk-token", "server-round"
