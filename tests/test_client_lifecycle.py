"""A client that is done leaves the trunk's step group, and a client cut elsewhere than the trunk is refused at
its first call, naming both cuts; the README's client, run twice as a user would, never waits for a timeout."""

from __future__ import annotations

import threading
import time
import uuid

import grpc
import pytest
import torch
from doc_blocks import ROOT, python_blocks

from splitfed.channel.client.remote import RemoteTrunk
from splitfed.channel.client.trunk import LEAVE_TIMEOUT_S, TrunkClient
from splitfed.channel.server.trunkserver import TrunkServer
from splitfed.errors import ChannelError, SplitError
from splitfed.models.catalog import build_model, mnist_cnn
from splitfed.split import CutState, SplitModel, split_model
from splitfed.trunk.aggregation.modes import SyncAggregator

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
    began = time.monotonic()
    client.close()  # the Leave fails quietly (the server would drop the member after its timeout anyway)
    assert time.monotonic() - began < LEAVE_TIMEOUT_S + 2.0
    assert client.member  # it did not leave: the Leave failed, and close() said nothing


def test_the_readme_client_twice_does_not_wait_for_the_trunk_timeout() -> None:
    """README's Python API: the server block once, then the client block twice, as a user reruns it. The second
    run's sync step must not wait for the first client, which closed."""
    blocks = python_blocks(ROOT / "README.md")
    server_at = next(i for i, b in enumerate(blocks) if "TrunkServer(" in b.code)
    server_block = blocks[server_at]
    client_block = next(b for b in blocks[server_at + 1:] if "RemoteTrunk(" in b.code)
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


def test_a_client_cut_elsewhere_is_refused_naming_both_cuts_and_the_server_keeps_serving() -> None:
    server = _cnn_server((3, 6))
    try:
        before = {k: v.clone() for k, v in server.runtime.trunk.state_dict().items()}
        wrong = split_model(mnist_cnn(), (2, 6))
        with RemoteTrunk(server.address, insecure=True) as trunk:
            model = SplitModel(wrong.bottom, trunk, wrong.top, task="classification")
            with pytest.raises(ChannelError) as caught:
                _step(model)
        assert caught.value.code == "INVALID_ARGUMENT"
        assert "cut at (2, 6)" in str(caught.value) and "[3, 6)" in str(caught.value)
        assert all(torch.equal(v, server.runtime.trunk.state_dict()[k]) for k, v in before.items())
        assert server.runtime.aggregator.members == frozenset()  # a refused client holds up nobody
        right = split_model(mnist_cnn(), (3, 6))
        with RemoteTrunk(server.address, insecure=True) as trunk:
            _step(SplitModel(right.bottom, trunk, right.top, task="classification"))
        assert server.runtime.version == 1
    finally:
        server.stop(grace=0)


def test_a_transformer_client_cut_elsewhere_is_refused_though_the_shapes_match() -> None:
    """Every GPT-2 block takes the same shape: without the cut on the wire the trunk would run the wrong blocks."""
    torch.manual_seed(0)
    server = TrunkServer(split_model(build_model("tiny-gpt2", vocab_size=64), (2, 4)).trunk, insecure=True).start()
    try:
        client = split_model(build_model("tiny-gpt2", vocab_size=64), (1, 4))
        ids = torch.randint(0, 64, (2, 8))
        with RemoteTrunk(server.address, insecure=True) as trunk:
            model = SplitModel(client.bottom, trunk, client.top, task="causal-lm")
            with pytest.raises(ChannelError, match=r"cut at \(1, 4\).*\[2, 4\)"):
                model(ids, labels=ids)
    finally:
        server.stop(grace=0)


def test_a_client_that_sends_no_cut_gets_the_trunk_cuts_in_the_shape_error() -> None:
    server = _cnn_server((3, 6))
    try:
        with TrunkClient(server.address, insecure=True) as client:
            with pytest.raises(ChannelError) as caught:
                client.forward(CutState(torch.randn(2, 16, 14, 14)), train=True)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT.name
        assert "16 channels" in str(caught.value) and "cuts=(3, 6)" in str(caught.value)
    finally:
        server.stop(grace=0)


def test_a_remote_trunk_given_another_cut_than_its_parts_is_refused_at_once() -> None:
    parts = split_model(mnist_cnn(), (3, 6))
    trunk = RemoteTrunk("127.0.0.1:1", insecure=True, cut=(1, 6))
    try:
        with pytest.raises(SplitError, match=r"cut=\(1, 6\).*\(3, 6\)"):
            SplitModel(parts.bottom, trunk, parts.top, task="classification")
    finally:
        trunk.close()
