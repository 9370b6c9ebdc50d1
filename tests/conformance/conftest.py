"""Fixtures of the conformance suite: ``transport`` (each of ``TRANSPORTS``) and ``conn``, a server of that transport
with a client that takes it, shared by a test module's tests."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from splitfed.channel.client.trunk import TrunkClient
from splitfed.channel.server.trunkserver import TrunkServer
from splitfed.channel.transports.shm import lane as shared

from .transports import TRANSPORTS, Transport


@pytest.fixture(scope="module", autouse=True)
def small_tensors_in_regions() -> Iterator[None]:
    """The tiny models' cut tensors (a few KiB) cross through regions too (the lane's floor is 64 KiB); per
    module, so the floor is back for every test outside this suite."""
    saved, shared.MIN_REGION_TENSOR_BYTES = shared.MIN_REGION_TENSOR_BYTES, 1
    yield
    shared.MIN_REGION_TENSOR_BYTES = saved


@pytest.fixture(scope="module", params=TRANSPORTS, ids=[t.name for t in TRANSPORTS])
def transport(request: pytest.FixtureRequest) -> Transport:
    """Each transport; one the machine cannot run skips with the reason (CUDA IPC without a GPU)."""
    t: Transport = request.param
    if why := t.missing():
        pytest.skip(why)
    return t


@dataclass
class Conn:
    """A server of one transport and a client that takes it."""

    transport: Transport
    server: TrunkServer
    client: TrunkClient

    def went(self) -> int:
        """Calls of the client that took the transport so far."""
        return self.transport.went(self.server, self.client)


@pytest.fixture(scope="module")
def conn(transport: Transport) -> Iterator[Conn]:
    """A server of ``transport`` (the tiny Llama's blocks [1, 3), SGD) and a client "alice" that takes it."""
    server = transport.open_server()
    client = transport.open_client(server, client_id="alice")
    try:
        yield Conn(transport, server, client)
    finally:
        client.close()
        server.stop(grace=0)
