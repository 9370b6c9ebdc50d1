"""Direct calls (splitfed.channel.transports.direct.server): a client's region-carried Forward and Backward go straight to the
engine's Unix socket, compute exactly what gRPC calls compute, and a connection can do only what its ticket
allows: admitted by a valid ticket only, run as the client the ticket was issued to, Forward and Backward only,
for as long as the region lasts; bad frames close the connection and the server keeps serving."""

from __future__ import annotations

import copy
import socket
import threading
import uuid

import pytest
import torch
from torch import nn

from splitfed.channel.security.tokens import TokenIssuer
from splitfed.channel.wire import fastwire
from splitfed.channel.transports.shm import lane as shared
from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.client.trunk import TrunkClient
from splitfed.channel.transports.direct.client import DirectLink
from splitfed.channel.wire.framing import FrameLimits, recv_frame, send_frame
from splitfed.channel.wire.limits import SERVICE_NAME
from splitfed.codec.tensors import WireDType, encode
from splitfed.errors import ChannelError
from splitfed.split import CutState
from splitfed.split.sequential import split_sequential


@pytest.fixture(autouse=True)
def small_tensors_too(monkeypatch) -> None:
    monkeypatch.setattr(shared, "MIN_REGION_TENSOR_BYTES", 1)


def _trunk() -> nn.Module:
    torch.manual_seed(0)
    return split_sequential(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)), 1, 2)[1]


def _steps(client: TrunkClient, n: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(1)
    seen = []
    for _ in range(n):
        x = torch.randn(5, 16)
        act = uuid.uuid4().hex
        out, _ = client.forward(CutState(x), activation_id=act)
        seen += [out, client.backward(act, out * 0.5).grad]
    return seen


def test_direct_calls_through_front_ends_compute_what_grpc_calls_compute(trunk_server) -> None:
    # Without front-ends, direct calls and gRPC calls against the unsplit model: tests/conformance/test_exactness.py.
    frontends = 1
    trunk = _trunk()
    direct = trunk_server(copy.deepcopy(trunk), frontends=frontends)
    grpc_only = trunk_server(copy.deepcopy(trunk), frontends=frontends, direct_calls=False)
    with TrunkClient(direct.address, insecure=True) as a, TrunkClient(grpc_only.address, insecure=True) as b:
        got, want = _steps(a), _steps(b)
        assert a.shared.calls == a.shared.direct_calls == 6
        assert b.shared.calls == 6 and b.shared.direct_calls == 0
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    for p, q in zip(direct.runtime.trunk.parameters(), grpc_only.runtime.trunk.parameters()):
        assert torch.equal(p, q)
    assert direct.direct.listener.stats["calls"] == 6


def test_a_client_that_asks_for_none_calls_over_grpc(trunk_server) -> None:
    server = trunk_server(_trunk())
    with TrunkClient(server.address, insecure=True, direct_calls=False) as client:
        _steps(client, 1)
        assert client.shared.calls == 2 and client.shared.direct_calls == 0
    assert server.direct.listener.stats["connections"] == 0


def test_a_refused_socket_sends_the_call_over_grpc(trunk_server) -> None:
    server = trunk_server(_trunk())
    with TrunkClient(server.address, insecure=True) as client:
        client.forward(CutState(torch.randn(5, 16)), train=False)  # opens the region and its link
        link = client.shared.region.direct
        # A ticket the engine never issued: it refuses the connection before any call is sent.
        client.shared.region.direct = DirectLink(link.path, "forged", server.address, 1 << 20)
        link.close()
        _steps(client, 1)
        assert client.shared.region.direct is None and client.shared.direct_calls == 1  # only the first went direct
    assert server.direct.listener.stats["refused"] == 1


def _send_frame(sock: socket.socket, header: dict, body: bytes = b"") -> None:
    send_frame(sock, header, [body])


def _recv_frame(sock: socket.socket, max_body: int) -> tuple[dict, memoryview]:
    return recv_frame(sock, FrameLimits(max_body))


def _raw(path: str, ticket: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(path)
    _send_frame(sock, {"ticket": ticket})
    return sock


def _forward_frame(act: str, claimed_client: str) -> tuple[dict, bytes]:
    request = pb.ForwardRequest(activation_id=act, train=True, reply_dtype=int(WireDType.FLOAT32), num_examples=5)
    body = fastwire.serialize(request, [encode("hidden", torch.randn(5, 16))])
    return {"id": 7, "method": f"/{SERVICE_NAME}/Forward", "timeout": 30,
            "md": [["x-splitfed-client-id", claimed_client], ["authorization", "Bearer forged"]]}, body


def test_a_ticket_admits_only_its_client_and_only_forward_and_backward(trunk_server) -> None:
    issuer = TokenIssuer("run-1")
    server = trunk_server(_trunk(), authenticate=issuer.authenticate)
    alice = TrunkClient(server.address, insecure=True, token=issuer.issue(1, 1))
    mallory = TrunkClient(server.address, insecure=True, token=issuer.issue(2, 1))
    try:
        alice.forward(CutState(torch.randn(5, 16)), train=False)
        link = alice.shared.region.direct
        with _raw(link.path, "not-a-ticket") as sock:
            with pytest.raises(ConnectionError):  # closed without a welcome
                _recv_frame(sock, 0)
        with _raw(link.path, link.ticket) as sock:
            assert _recv_frame(sock, 0)[0] == {"admitted": True}
            # The frame claims another client and a forged token: it runs as Alice, whose ticket this is.
            header, body = _forward_frame("act-1", "mallory")
            _send_frame(sock, header, body)
            reply, _ = _recv_frame(sock, 1 << 20)
            assert reply["code"] == "OK" and reply["id"] == 7
            _send_frame(sock, {"id": 8, "method": f"/{SERVICE_NAME}/Join", "timeout": 30})
            reply, _ = _recv_frame(sock, 1 << 20)
            assert reply["code"] == "PERMISSION_DENIED" and "Forward and Backward only" in reply["details"]
            _send_frame(sock, {"id": 9, "method": f"/{SERVICE_NAME}/Forward", "timeout": "soon"}, body)
            reply, _ = _recv_frame(sock, 1 << 20)
            assert reply["code"] == "INVALID_ARGUMENT" and "timeout" in reply["details"]
            for bad in (-1, 1.5, "1", True):
                _send_frame(sock, {**header, "id": 10, "retry": bad}, body)
                reply, _ = _recv_frame(sock, 1 << 20)
                assert reply["code"] == "INVALID_ARGUMENT" and "retry" in reply["details"], bad
            # The same forward again: as a retry (its reply was lost) it is answered from the saved forward; as a
            # new call its step id is refused.
            _send_frame(sock, {**header, "id": 11, "retry": 1}, body)
            reply, _ = _recv_frame(sock, 1 << 20)
            assert reply["code"] == "OK" and reply["id"] == 11, reply
            _send_frame(sock, {**header, "id": 12}, body)
            reply, _ = _recv_frame(sock, 1 << 20)
            assert reply["code"] == "ALREADY_EXISTS", reply
        with pytest.raises(ChannelError) as info:
            mallory.backward("act-1", torch.ones(5, 16))
        assert info.value.code == "PERMISSION_DENIED"  # the forward is Alice's
        assert alice.backward("act-1", torch.ones(5, 16)).outcome == "APPLIED"
    finally:
        alice.close()
        mallory.close()


def test_a_ticket_ends_with_its_region(trunk_server) -> None:
    server = trunk_server(_trunk())
    client = TrunkClient(server.address, insecure=True)
    client.forward(CutState(torch.randn(5, 16)), train=False)
    link = client.shared.region.direct
    path, ticket = link.path, link.ticket
    sock = _raw(path, ticket)
    assert _recv_frame(sock, 0)[0] == {"admitted": True}
    client.shared.close()  # CloseRegion
    header, body = _forward_frame("act-2", "")
    _send_frame(sock, header, body)
    reply, _ = _recv_frame(sock, 1 << 20)
    assert reply["code"] == "UNAUTHENTICATED" and "ended with the region" in reply["details"]
    sock.close()
    with _raw(path, ticket) as again, pytest.raises(ConnectionError):
        _recv_frame(again, 0)
    _steps(client, 1)  # a new region, a new ticket: direct again
    assert client.shared.direct_calls == 3
    client.close()


def test_malformed_frames_close_the_connection_and_the_server_keeps_serving(trunk_server) -> None:
    server = trunk_server(_trunk())
    with TrunkClient(server.address, insecure=True) as client:
        client.forward(CutState(torch.randn(5, 16)), train=False)
        link = client.shared.region.direct
        for garbage in (b"\x00\x00\x00\x05\x00\x00\x00\x00{oops", b"\x00\x00\x00\x02\x00\x00\x00\x00[]",
                        b"\xff\xff\xff\xff\x00\x00\x00\x00"):
            with _raw(link.path, link.ticket) as sock:
                assert _recv_frame(sock, 0)[0] == {"admitted": True}
                sock.sendall(garbage)
                with pytest.raises(ConnectionError):
                    _recv_frame(sock, 1 << 20)
        with _raw(link.path, link.ticket) as sock:  # a Forward whose bytes do not parse: a status, not a crash
            assert _recv_frame(sock, 0)[0] == {"admitted": True}
            _send_frame(sock, {"id": 1, "method": f"/{SERVICE_NAME}/Forward", "timeout": 30}, b"\x0a\xff\xff")
            reply, _ = _recv_frame(sock, 1 << 20)
            assert reply["code"] == "INVALID_ARGUMENT"
        _steps(client, 2)
        assert client.shared.direct_calls == 5


def test_threads_of_one_client_call_direct_at_once(trunk_server) -> None:
    """Each thread's call takes a connection of its own: every reply reaches the call it answers."""
    server = trunk_server(_trunk())
    inputs = {f"t{i}": torch.randn(5, 16) + i for i in range(8)}
    with TrunkClient(server.address, insecure=True) as client:
        client.forward(CutState(torch.randn(5, 16)), train=False)
        results: dict[str, torch.Tensor] = {}
        errors: list[BaseException] = []

        def run(name: str) -> None:
            try:
                for _ in range(20):
                    out, _ = client.forward(CutState(inputs[name]), train=False)
                    if name in results:
                        assert torch.equal(out, results[name]), name
                    results[name] = out
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(name,)) for name in inputs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        trunk = server.runtime.trunk
        with torch.no_grad():
            for name, x in inputs.items():
                assert torch.allclose(results[name], trunk(CutState(x)).hidden, atol=1e-6)
        assert client.shared.direct_calls == 1 + 8 * 20


def test_a_silent_connection_is_closed(trunk_server, monkeypatch) -> None:
    from splitfed.channel.engine import link as enginelink

    monkeypatch.setattr(enginelink, "HELLO_TIMEOUT_S", 0.3)
    server = trunk_server(_trunk())
    with TrunkClient(server.address, insecure=True) as client:
        client.forward(CutState(torch.randn(5, 16)), train=False)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(client.shared.region.direct.path)
            with pytest.raises(ConnectionError):  # no ticket sent: closed, not held
                _recv_frame(sock, 0)
        _steps(client, 1)


def test_closing_a_connection_cancels_its_calls_in_flight(trunk_server) -> None:
    import time

    server = trunk_server(_trunk())
    listener = server.direct.listener
    alice = TrunkClient(server.address, insecure=True, client_id="alice")
    bob = TrunkClient(server.address, insecure=True, client_id="bob")
    try:
        alice.forward(CutState(torch.randn(5, 16)), train=False)
        assert alice.join() == 1 and bob.join() == 2
        sock = _raw(alice.shared.region.direct.path, alice.shared.region.direct.ticket)
        assert _recv_frame(sock, 0)[0] == {"admitted": True}
        header, body = _forward_frame("act-3", "")
        _send_frame(sock, header, body)
        assert _recv_frame(sock, 1 << 20)[0]["code"] == "OK"
        grad = fastwire.serialize(pb.BackwardRequest(activation_id="act-3", reply_dtype=int(WireDType.FLOAT32)),
                                  [encode("grad", torch.ones(5, 16))])
        _send_frame(sock, {"id": 8, "method": f"/{SERVICE_NAME}/Backward", "timeout": 60}, grad)
        def calls() -> int:  # the listener's calls in flight (beside its connections)
            return sum(t.get_coro().__name__ == "_call" for t in list(listener._tasks))

        deadline = time.monotonic() + 10
        while calls() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert calls() == 1  # the Backward: the sync step waits for Bob's gradient
        sock.close()
        deadline = time.monotonic() + 10
        while calls() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert calls() == 0
    finally:
        alice.close()
        bob.close()


def test_a_new_token_drops_the_ticket_of_the_old_one(trunk_server) -> None:
    """A ticket runs as the token it was issued for: after ``set_token`` the region's calls carry the new one."""
    issuer = TokenIssuer("run-2")
    server = trunk_server(_trunk(), authenticate=issuer.authenticate)
    with TrunkClient(server.address, insecure=True, token=issuer.issue(1, 1)) as client:
        _steps(client, 1)
        assert client.shared.direct_calls == 2
        client.set_token(issuer.issue(1, 2))  # the next round's token: the old one is now a replay
        _steps(client, 1)
        assert client.shared.calls == 4 and client.shared.direct_calls == 2
