"""A call's buffers live as long as the call, not until the next garbage collection.

The trunk server and client gather a streamed tensor's chunks into one buffer per call. A reference cycle around
that buffer (a finished call's frame, its task and the exception that ended the reply stream) keeps it alive until
the cyclic collector runs, which a server tuned for serving does rarely: every call then takes fresh memory (a
16 MiB call spent most of its time in page faults) and the process holds every buffer since the last collection.
A refused call (NaN in its tensor) is answered with an error whose traceback holds the frames it came through; a
frame holding the future, task or call context the error was set on closes a cycle around the refused request. So
does a closed connection whose kept error is raised again (its traceback holds the connection and its buffers).
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from splitfed.channel.client.trunk import TrunkClient
from splitfed.channel.server.trunkserver import ChannelLimits
from splitfed.channel.wire import messages
from splitfed.errors import ChannelError
from splitfed.split import CutState
from splitfed.split.sequential import split_sequential

LIMITS = ChannelLimits(max_message_bytes=1 << 20, stream_threshold_bytes=64 << 10, chunk_bytes=16 << 10)


@pytest.fixture
def gathered(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, weakref.ref[np.ndarray]]]]:
    """Every buffer a streamed message is gathered into, with the thread that asked for it; no cyclic collection
    while the test runs."""
    made: list[tuple[str, weakref.ref[np.ndarray]]] = []
    alloc: Callable[[int], np.ndarray] = messages._numpy_bytes

    def tracked(n: int) -> np.ndarray:
        buf = alloc(n)
        made.append((threading.current_thread().name, weakref.ref(buf)))
        return buf

    monkeypatch.setattr(messages, "_numpy_bytes", tracked)
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield made
    finally:
        if was:
            gc.enable()


def _identity_trunk() -> torch.nn.Module:
    """A trunk that returns its input: the calls' bytes are all there is to hold."""
    return split_sequential(torch.nn.Sequential(torch.nn.Identity(), torch.nn.Identity(), torch.nn.Identity()),
                            1, 2)[1]


def _held_by_cycles(min_bytes: int) -> list[str]:
    """What the cyclic collector finds unreachable now that holds an array, tensor or bytes of ``min_bytes`` or
    more (each found object is freed afterwards)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
    finally:
        gc.set_debug(0)
    held = []
    for obj in gc.garbage:
        for ref in gc.get_referents(obj):
            if isinstance(ref, (np.ndarray, memoryview)):
                size = ref.nbytes
            elif isinstance(ref, torch.Tensor):
                size = ref.numel() * ref.element_size()
            elif isinstance(ref, (bytes, bytearray)):
                size = len(ref)
            else:
                continue
            if size >= min_bytes:
                held.append(f"{type(obj).__name__} -> {type(ref).__name__} of {size} bytes")
    gc.garbage.clear()
    gc.collect()
    return held


def _alive(made: list[tuple[str, weakref.ref[np.ndarray]]], server: bool) -> int:
    return sum(1 for thread, ref in made if (thread != "MainThread") == server and ref() is not None)


def test_a_streamed_calls_buffers_go_when_it_ends(trunk_server, gathered) -> None:
    server = trunk_server(_identity_trunk(), limits=LIMITS)
    client = TrunkClient(server.address, insecure=True, limits=LIMITS, shared_memory="off")
    state = CutState(torch.randn(4, 64, 256))  # 256 KiB each way: streamed in 16 chunks
    calls = 6
    for _ in range(calls):
        out, _ = client.forward(state, train=False)
        assert torch.equal(out, state.hidden)
    del out
    client.close()
    assert sum(1 for thread, _ in gathered if thread != "MainThread") == calls  # the server gathered each request
    deadline = time.monotonic() + 5.0
    while _alive(gathered, server=True) > 1 and time.monotonic() < deadline:  # the last call's handler may linger
        time.sleep(0.02)
    assert _alive(gathered, server=True) <= 1, "streamed requests' buffers are held until a garbage collection"
    assert _alive(gathered, server=False) == 0


@pytest.mark.parametrize(("rows", "over"), [(12, {}), (64, {}), (64, {"bulk_connections": 2}),
                                            (64, {"shared_memory": "on"})],
                         ids=["unary", "streamed", "bulk-link", "shared-memory"])
def test_a_refused_calls_request_is_not_kept(trunk_server, gathered, rows: int, over: dict[str, object]) -> None:
    server = trunk_server(_identity_trunk(), limits=LIMITS, bulk_connections=2)
    client = TrunkClient(server.address, insecure=True, limits=LIMITS, **({"shared_memory": "off"} | over))
    bad = CutState(torch.full((4, rows, 256), float("nan")))  # 48 KiB in one message, or 256 KiB in chunks
    for train in (False, True, False, True):
        with pytest.raises(ChannelError, match="NaN or Inf") as refused:
            client.forward(bad, train=train)
        assert refused.value.code == "INVALID_ARGUMENT"
    del refused
    out, _ = client.forward(CutState(torch.ones(4, rows, 256)), train=False)  # still serving
    assert torch.equal(out, torch.ones(4, rows, 256))
    client.close()
    time.sleep(0.2)  # the server's side of the last call (and of closed connections) ends after the client's
    assert _held_by_cycles(bad.hidden.nbytes // 2) == []
