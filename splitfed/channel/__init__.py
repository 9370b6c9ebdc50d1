"""The split channel: the only gRPC code of splitfed.

Its layers, lowest first (each imports only those below it; tests/test_layering.py holds this, docs/architecture.md
says why): ``wire`` (messages, frames, limits), ``security`` (TLS, tokens), ``engine`` (the event loop, front-end
processes and their link to the engine), ``transports`` (grpc, shm, bulk, direct), then ``client``, ``admin``,
``server`` and ``routing``.
"""

import os

# gRPC's core reads its log level once, when first imported: keep its connection chatter (a peer's GOAWAY as a
# server stops, ...) off stderr and show errors only, as Flower does, unless GRPC_VERBOSITY says otherwise.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
