"""The split channel: the only gRPC code of splitfed."""

import os

# gRPC's core reads its log level once, when first imported: keep its connection chatter (a peer's GOAWAY as a
# server stops, ...) off stderr and show errors only, as Flower does, unless GRPC_VERBOSITY says otherwise.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
