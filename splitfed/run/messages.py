"""Keys of the values the ServerApp adds to each message and the ClientApp reads.

SplitFed's per-node values (the trunk's address, a token, the round) travel inside the message's one
ConfigRecord (Flower's ``"config"``), each key prefixed with :data:`SPLITFED_PREFIX`, so a message looks to
Flower's code (``fixedclipping_mod``, ``adaptiveclipping_mod``, any mod that wants exactly one ConfigRecord)
as Flower's own does. Flower's keys (``clipping_norm``, ``lr``, ``proximal-mu``...) have no such prefix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Prefix of SplitFed's keys in the message's ConfigRecord.
SPLITFED_PREFIX = "splitfed."

#: SplitFed's per-node keys (in the ConfigRecord: ``splitfed.trunk-address`` and so on).
TRUNK_ADDRESS, TRUNK_TOKEN, SERVER_ROUND = "trunk-address", "trunk-token", "server-round"
#: The trunk's CA certificate (PEM), for clients to pin under zero-configuration TLS.
TRUNK_CA = "trunk-ca"
#: JSON of the privacy accountants the server holds, by client key.
PRIVACY_STATES = "privacy-states"
#: Which client-side clipping the server's strategy expects ("fixed" or "adaptive"); absent: none.
CLIENT_CLIPPING = "client-clipping"

#: Name of the ConfigRecord in a train reply that carries the client's accountants (and its key).
PRIVACY_RECORD = "splitfed-privacy"
#: In that record: the client's key (its partition id), stable across runs and restarts.
CLIENT_KEY = "client-key"

#: Name of the ConfigRecord in a train reply of a run with client-cuts: the client's cut (bottom end, top start).
CUT_RECORD = "splitfed-cut"
CUT_START, CUT_END = "cut-start", "cut-end"


def with_prefix(values: Mapping[str, Any]) -> dict[str, Any]:
    """SplitFed's values under their ConfigRecord keys (``trunk-token`` -> ``splitfed.trunk-token``)."""
    return {SPLITFED_PREFIX + key: value for key, value in values.items()}


def splitfed_values(config: Mapping[str, Any]) -> dict[str, Any]:
    """SplitFed's values in a message's ConfigRecord, prefix removed."""
    return {key[len(SPLITFED_PREFIX):]: value for key, value in config.items() if key.startswith(SPLITFED_PREFIX)}


def strategy_values(config: Mapping[str, Any]) -> dict[str, Any]:
    """What the strategy put in the ConfigRecord (``lr``, ``proximal-mu``, ``clipping_norm``, custom keys):
    everything but SplitFed's own keys."""
    return {key: value for key, value in config.items() if not key.startswith(SPLITFED_PREFIX)}
