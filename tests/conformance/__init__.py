"""One conformance suite over every transport: the same tests run over each way a tensor crosses the cut.

The transports are the adapters in ``transports.py`` (``TRANSPORTS``); each test takes the ``transport`` fixture
(or ``conn``, a server of that transport with a client that takes it) and checks that its calls really went that
way. A transport added later gets every test by adding one line to ``TRANSPORTS``.

| behaviour (module) | grpc | shm | bulk | direct | frontend | cuda-ipc |
| --- | --- | --- | --- | --- | --- | --- |
| split steps equal the unsplit model (`test_exactness`) | runs | runs | runs | runs | runs | GPU only |
| hostile-input catalogue, 23 cases, then health, trunk unchanged, a good step over the same transport (`test_bad_inputs`) | runs | runs | runs (a) | runs | runs | GPU only |
| a wrong or missing token is UNAUTHENTICATED (`test_bad_inputs`) | runs | runs (b) | runs (b) | runs (b) | runs | GPU only |
| a call whose reply is lost is retried and applied once (`test_retries`) | runs | runs | runs (c) | runs | runs | GPU only |
| a step id used twice is refused, the first step completes (`test_retries`) | runs | runs | runs | runs | runs | GPU only |
| a call past its deadline: DEADLINE_EXCEEDED, its gradient still in the sync step (`test_deadlines`) | runs | runs | runs | runs | runs | GPU only |
| TLS: a TLS server carries the transport; plaintext and untrusting clients refused (`test_tls`) | runs | runs | runs (TLS link) | runs (d) | runs | GPU only |

The front-end transport: the server's port is served by a front-end process (``frontends=1``), which hands each
call to the engine over the engine link; its calls are counted on the engine's side, per client.
"GPU only": CUDA IPC needs client and trunk on one CUDA device; without one its tests skip saying so. On an NVIDIA
H100 (torch 2.11+cu130) its 29 tests pass, and the other transports' 145 with them.

(a) Two cases break a bulk link's own protocol (bytes-vs-shape: the transfer's size disagrees with its header;
oversize: a transfer past the largest tensor the link takes): the server closes that link, the call is retried
over gRPC and refused there (docs/bad_inputs.md, bulk links). They are sent by a client of their own.
(b) The region or link a client with a wrong token would open is refused too, so its call goes over gRPC and is
refused there; the client with the valid token is checked to take the transport.
(c) A bulk call that fails UNAVAILABLE gives its link up and is retried over gRPC chunks (by design: the link may be
what failed); its retry is answered from what the first attempt left, like any other.
(d) The Unix socket of direct calls carries no TLS: it is loopback-only by design, in a directory only the
server's user may enter. What runs is the TLS channel that issues the ticket admitting a client to it.

Not here, because they belong to one transport's own framing, are its per-transport tests: malformed gRPC streams
(tests/test_channel.py: truncated-stream, chunk-out-of-order, stream-overflow, stream-without-header, oversize unary
message), region slices (test_channel.py's REGION_CASES), bulk handshakes and stripes (tests/test_bulk.py), direct
tickets and frames (tests/test_direct_calls.py), socket frames (tests/test_framing.py); the catalogue in every trunk
mode runs over gRPC in test_channel.py.

The cases differ by how a request's tensors travel (``Transport.carriage``) in one way only: a tensor past the
server's largest is INVALID_ARGUMENT inline in a unary message (the catalogue's huge-declared-unary) and
RESOURCE_EXHAUSTED streamed (huge-declared-stream) or in a region; a declared shape its slice cannot hold is
INVALID_ARGUMENT in a region.
"""
