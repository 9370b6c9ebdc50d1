"""Keys of the records the ServerApp adds to each message and the ClientApp reads."""

from __future__ import annotations

#: Keys of the per-node "splitfed" ConfigRecord the ServerApp adds to each message.
TRUNK_ADDRESS, TRUNK_TOKEN, SERVER_ROUND = "trunk-address", "trunk-token", "server-round"
#: The trunk's CA certificate (PEM) in that record, for clients to pin under zero-configuration TLS.
TRUNK_CA = "trunk-ca"

#: In the "splitfed" ConfigRecord: JSON of the privacy accountants the server holds, by client key.
PRIVACY_STATES = "privacy-states"
#: Name of the ConfigRecord in a train reply that carries the client's accountants (and its key).
PRIVACY_RECORD = "splitfed-privacy"
#: In that record: the client's key (its partition id), stable across runs and restarts.
CLIENT_KEY = "client-key"

#: Name of the ConfigRecord in a train reply of a run with client-cuts: the client's cut (bottom end, top start).
CUT_RECORD = "splitfed-cut"
CUT_START, CUT_END = "cut-start", "cut-end"
