"""A client that is done leaves the trunk's step group: the README's client, run twice as a user would, never
waits for a timeout."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch
from doc_blocks import ROOT, python_blocks

from splitfed.channel.client import RemoteTrunk, TrunkClient
from splitfed.channel.server import TrunkServer
from splitfed.models import mnist_cnn
from splitfed.split import CutState, SplitModel, split_model
from splitfed.trunk.aggregation import SyncAggregator

pytestmark = pytest.mark.usefixtures("one_thread")

#: A sync step that would wait this long for a member that never leaves: far beyond any test's deadline.
NEVER = 3600.0


def _cnn_server(cuts: tuple[int, int] = (3, 6)) -> TrunkServer:
    torch.manual_seed(0)
    return TrunkServer(split_model(mnist_cnn(), cuts).trunk, insecure=True,
                       aggregator=SyncAggregator(timeout=NEVER)).start()


def _step(model: SplitModel, n: int = 4) -> None:
    """One training forward and backward of ``n`` random images."""
    model(torch.randn(n, 1, 28, 28), labels=torch.arange(n) % 10).loss.backward()


def test_close_and_with_leave_the_step_group() -> None:
    server = _cnn_server()
    try:
        parts = split_model(mnist_cnn(), (3, 6))
        with RemoteTrunk(server.address, insecure=True) as trunk:
            _step(SplitModel(parts.bottom, trunk, parts.top, task="classification"))
            assert len(server.runtime.aggregator.members) == 1
        assert server.runtime.aggregator.members == frozenset()
        client = TrunkClient(server.address, insecure=True)
        client.forward(CutState(torch.randn(2, 32, 14, 14)), activation_id=uuid.uuid4().hex, train=True)
        assert len(server.runtime.aggregator.members) == 1
        client.close()
        assert server.runtime.aggregator.members == frozenset()
        # Evaluation never joins, so closing an evaluating client sends nothing.
        with TrunkClient(server.address, insecure=True) as client:
            client.forward(CutState(torch.randn(2, 32, 14, 14)), train=False)
            assert not client.member
    finally:
        server.stop(grace=0)


def test_closing_a_client_of_a_server_that_is_gone_does_not_hang() -> None:
    server = _cnn_server()
    client = TrunkClient(server.address, insecure=True)
    client.forward(CutState(torch.randn(2, 32, 14, 14)), activation_id=uuid.uuid4().hex, train=True)
    server.stop(grace=0)
    client.close()  # the Leave fails quietly (the server would drop the member after its timeout anyway)


def test_the_readme_client_twice_does_not_wait_for_the_trunk_timeout() -> None:
    """README's Python API: the server block once, then the client block twice, as a user reruns it. The second
    run's sync step must not wait for the first client, which closed."""
    server_block, client_block = python_blocks(ROOT / "README.md")[:2]
    assert "TrunkServer(" in server_block.code and "RemoteTrunk(" in client_block.code
    # A free port, and a trunk that would wait (practically) forever for a member that never left.
    server_code = server_block.code.replace("port=50051, insecure=True)",
                                            f"port=0, insecure=True, aggregator=SyncAggregator(timeout={NEVER}))")
    namespace: dict[str, object] = {"SyncAggregator": SyncAggregator}
    exec(compile(server_code, server_block.label, "exec"), namespace)
    server = namespace["server"]
    assert isinstance(server, TrunkServer)
    client_code = compile(client_block.code.replace("127.0.0.1:50051", server.address), client_block.label, "exec")
    try:
        exec(client_code, namespace)
        assert server.runtime.version == 1 and server.runtime.aggregator.members == frozenset()
        errors: list[BaseException] = []

        def again() -> None:
            try:
                exec(client_code, namespace)
            except BaseException as exc:  # reported below
                errors.append(exc)

        second = threading.Thread(target=again, daemon=True)
        second.start()
        second.join(120)
        assert not second.is_alive(), "the second client waits for the first one, which never left the step group"
        assert not errors and server.runtime.version == 2
    finally:
        server.stop(grace=0)
