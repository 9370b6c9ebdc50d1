"""Bulk links: streamed calls' tensor bytes over TCP connections beside gRPC (splitfed.channel.transports.bulk.links)."""

from __future__ import annotations

import copy
import socket
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np
import pytest
import torch
from conftest import batch_for, tiny_model

from splitfed.channel.transports.bulk import links as bulk
from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.wire import split_channel_pb2_grpc as pb_grpc
from splitfed.channel.transports.bulk.links import BulkLink, hello, segment, stripes
from splitfed.channel.client.remote import RemoteTrunk
from splitfed.channel.client.trunk import TrunkClient
from splitfed.channel.wire.framing import HELLO_LIMITS, pieces, recv_frame, send_frame
from splitfed.channel.wire.limits import CLIENT_ID_KEY, ChannelLimits
from splitfed.channel.wire.messages import encode_state, frames
from splitfed.errors import BulkLinkError, ConfigError
from splitfed.split import SplitModel, split_model
from splitfed.split.base import CutState

pytestmark = pytest.mark.usefixtures("one_thread")

# Tiny models' cut tensors (a few KiB) stream, in several chunks, and stripe over the link's connections.
LIMITS = ChannelLimits(max_message_bytes=1 << 20, stream_threshold_bytes=2 << 10, chunk_bytes=1000)
STEPS = 4


@pytest.fixture
def small_stripes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bulk, "MIN_STRIPE_BYTES", 512)


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)


# -- the link itself ----------------------------------------------------------------------------------------
def test_stripes_cover_every_byte_once(small_stripes: None) -> None:
    for total in (1, 511, 512, 513, 2048, 2049, 100_003):
        for connections in (1, 2, 3, 4, 16):
            parts = stripes(total, connections)
            assert 1 <= len(parts) <= connections
            assert parts[0][0] == 0 and sum(length for _, length in parts) == total
            assert all(a + n == b for (a, n), (b, _) in zip(parts, parts[1:]))
    assert stripes(0, 4) == []
    assert len(stripes(600, 4)) == 1  # stripes of at least MIN_STRIPE_BYTES


def _pair(connections: int, **kwargs: object) -> tuple[BulkLink, BulkLink]:
    pairs = [socket.socketpair() for _ in range(connections)]
    a = BulkLink("t", [p[0] for p in pairs], **kwargs).start()  # type: ignore[arg-type]
    b = BulkLink("t", [p[1] for p in pairs], **kwargs).start()  # type: ignore[arg-type]
    return a, b


def test_a_link_carries_transfers_both_ways_over_its_connections(small_stripes: None) -> None:
    a, b = _pair(3)
    try:
        rng = np.random.default_rng(0)
        parts = [rng.integers(0, 255, n, dtype=np.uint8) for n in (700, 1, 1500, 333)]
        whole = np.concatenate(parts)
        futures = a.send(5, [memoryview(p) for p in parts], len(whole))
        assert len(futures) == 3  # one stripe per connection
        got = b.take(5, len(whole), timeout=10)
        assert bytes(got) == whole.tobytes()
        for future in futures:
            future.result(10)
        b.send(5, [memoryview(whole)], len(whole))  # the reply travels under the request's number
        assert bytes(a.take(5, len(whole), timeout=10)) == whole.tobytes()
        assert a.bytes_sent == b.bytes_received == len(whole)
    finally:
        a.close()
        b.close()


def test_a_transfer_that_does_not_come_times_out_and_holds_nothing(small_stripes: None) -> None:
    a, b = _pair(2)
    try:
        with pytest.raises(BulkLinkError, match="did not arrive within"):
            b.take(9, 4096, timeout=0.2)
        assert b._pending == 0 and not b._transfers
        assert b.closed is None  # the link itself is fine
    finally:
        a.close()
        b.close()


def test_transfers_nobody_takes_lapse_and_the_link_goes_on(small_stripes: None, monkeypatch) -> None:
    monkeypatch.setattr(bulk, "TRANSFER_TTL_S", 0.05)
    a, b = _pair(2)
    try:
        data = memoryview(np.arange(3000, dtype=np.uint8).tobytes())
        for future in a.send(1, [data], len(data)):  # arrives whole; nobody takes it
            future.result(10)
        deadline = time.monotonic() + 10
        while b.bytes_received < len(data) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        a.send(2, [data], len(data))  # its arrival drops transfer 1, which had completed
        assert bytes(b.take(2, len(data), timeout=10)) == bytes(data)
        assert b.closed is None and list(b._transfers) == [] and b._pending == 0
        with pytest.raises(BulkLinkError, match="did not arrive"):
            b.take(1, len(data), timeout=0.1)  # lapsed: gone
    finally:
        a.close()
        b.close()


def _closed(sock: socket.socket) -> bool:
    """Whether the other end closed ``sock`` (reset, when it left bytes unread)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _raw_segment(sock: socket.socket, transfer: int, total: int, offset: int, length: int) -> None:
    send_frame(sock, segment(transfer, total, offset), [bytes(length)])


@pytest.mark.parametrize("case", ["off-stripe", "twice", "too-large", "total-changes", "over-pending"])
def test_a_peer_that_breaks_the_protocol_closes_the_link_before_memory_is_lent(case: str, small_stripes: None) -> None:
    allocated: list[int] = []

    def alloc(n: int) -> np.ndarray:
        allocated.append(n)
        return np.empty(n, dtype=np.uint8)

    pairs = [socket.socketpair() for _ in range(2)]
    link = BulkLink("t", [p[1] for p in pairs], alloc=alloc, max_bytes=10_000, max_pending_bytes=12_000).start()
    peer = [p[0] for p in pairs]
    try:
        if case == "off-stripe":  # connection 1 sends connection 0's stripe
            _raw_segment(peer[1], 1, 2048, 0, 1024)
        elif case == "twice":  # so that no byte of the buffer stays unwritten, a stripe comes once
            _raw_segment(peer[0], 1, 2048, 0, 1024)
            _raw_segment(peer[0], 1, 2048, 0, 1024)
        elif case == "too-large":
            _raw_segment(peer[0], 1, 10_001, 0, 5001)
        elif case == "total-changes":
            _raw_segment(peer[0], 1, 2048, 0, 1024)
            _raw_segment(peer[1], 1, 4096, 2048, 2048)
        else:  # two transfers of 8000 bytes pending at once: more than 12,000 bytes held
            _raw_segment(peer[0], 1, 8000, 0, 4000)
            _raw_segment(peer[0], 2, 8000, 0, 4000)
        deadline = time.monotonic() + 10
        while link.closed is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert link.closed is not None
        assert _closed(peer[0])  # the link's connections are closed
        # At most the one transfer's buffer (with "total-changes", whichever total came first).
        assert sum(allocated) <= {"too-large": 0, "over-pending": 8000, "total-changes": 4096}.get(case, 2048)
    finally:
        link.close()
        for sock in peer:
            sock.close()


# -- over the split channel -------------------------------------------------------------------------------
def _train(arch: str, trunk_server, *, bulk_connections: int, wire: str = "none", kill_after: int | None = None
           ) -> tuple[float, object, RemoteTrunk]:
    """``STEPS`` SGD steps of the split model against the unsplit one; returns the largest weight difference,
    the server and the client's trunk."""
    model = tiny_model(arch).train()
    ref = copy.deepcopy(model)
    inputs, mask, labels = batch_for(arch, batch=6, padded=True)
    split = split_model(model, (1, 3))
    server = trunk_server(split.trunk, lr=0.05, limits=LIMITS, bulk_connections=3)
    remote = RemoteTrunk(server.address, insecure=True, limits=LIMITS, shared_memory="off",
                         bulk_connections=bulk_connections, wire_compression=wire)
    net = SplitModel(split.bottom, remote, split.top, task=split.task)
    opt = torch.optim.SGD(split.client_modules().parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)

    def before(step: int) -> None:
        if kill_after is not None and step == kill_after:
            for _, link in list(server.bulk._links.values()):
                link.close("closed by the test")
    side_by_side(net, opt, ref, ref_opt, (inputs, mask, labels), before)
    remote.close()
    return _max_diff(model, ref), server, remote


def side_by_side(net: torch.nn.Module, opt: torch.optim.Optimizer, ref: torch.nn.Module,
                 ref_opt: torch.optim.Optimizer, batch: tuple, before: Callable[[int], None] | None = None) -> None:
    """``STEPS`` SGD steps of the split model ``net`` and the unsplit ``ref`` on ``batch`` (ids, mask, labels);
    ``before(step)`` runs ahead of each."""
    inputs, mask, labels = batch
    for step in range(STEPS):
        if before is not None:
            before(step)
        net(inputs, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
        ref(input_ids=inputs, attention_mask=mask, labels=labels).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()


# The tiny Llama over a bulk link: tests/conformance/test_exactness.py.
@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_sgd_steps_over_a_bulk_link_equal_the_unsplit_model(arch: str, trunk_server, small_stripes: None) -> None:
    diff, server, remote = _train(arch, trunk_server, bulk_connections=3)
    assert diff <= 1e-6
    client = remote.client
    assert client.bulk.calls == 2 * STEPS and client.bulk.failed is None  # every Forward and Backward
    assert client.bulk.link.bytes_sent == client.bytes_sent  # every byte sent went over the link
    assert client.bulk.link.bytes_received == client.bytes_received
    assert server.runtime.version == STEPS


def test_int8_tensors_cross_a_bulk_link_as_they_stream_over_grpc(trunk_server, small_stripes: None) -> None:
    # Compressed tensors carry their scales after their data: the same bytes, in the same order, as chunks.
    over_bulk, server_a, remote = _train("gpt2", trunk_server, bulk_connections=2, wire="int8")
    over_grpc, server_b, _ = _train("gpt2", trunk_server, bulk_connections=0, wire="int8")
    assert remote.client.bulk.calls == 2 * STEPS
    trunk_a, trunk_b = server_a.runtime.trunk.state_dict(), server_b.runtime.trunk.state_dict()
    assert all(torch.equal(trunk_a[k], trunk_b[k]) for k in trunk_a)
    assert over_bulk == over_grpc


def test_a_link_that_breaks_is_given_up_and_the_call_retried_over_grpc(trunk_server, small_stripes: None,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    diff, server, remote = _train("gpt2", trunk_server, bulk_connections=3, kill_after=2)
    assert diff <= 1e-6  # a retried call is answered from what its first attempt left: nothing applied twice
    client = remote.client
    assert client.bulk.failed is not None and "streaming over gRPC instead" in caplog.text
    assert client.bulk.calls == 4  # the first two steps
    assert server.runtime.version == STEPS


def test_a_server_without_bulk_links_is_streamed_to_over_grpc(trunk_server) -> None:
    model = tiny_model("gpt2")
    server = trunk_server(split_model(model, (1, 3)).trunk, limits=LIMITS)
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.SplitChannelStub(channel).OpenBulk(pb.OpenBulkRequest(connections=4), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "bulk" in info.value.details()
    client = TrunkClient(server.address, insecure=True, limits=LIMITS, shared_memory="off", bulk_connections=4)
    state = CutState(torch.randn(4, 16, model.config.n_embd), None, None)
    out, _ = client.forward(state, train=False)
    assert out.shape == state.hidden.shape and client.bulk.calls == 0 and "could not be opened" in client.bulk.failed
    client.close()


def test_bulk_links_need_tls_on_a_tls_server_and_exclude_front_ends() -> None:
    from splitfed.channel.server.trunkserver import TrunkServer

    creds = grpc.local_server_credentials()  # any credentials: the server serves TLS-like transport security
    with pytest.raises(ConfigError, match="need TLS too"):  # (tests/test_bulk_tls.py: TLS links)
        TrunkServer(torch.nn.Linear(2, 2), credentials=creds, bulk_connections=2)
    with pytest.raises(ConfigError, match="exclude each other"):
        TrunkServer(torch.nn.Linear(2, 2), insecure=True, bulk_connections=2, frontends=2)


def test_bulk_links_listen_on_the_port_asked_for(trunk_server) -> None:
    from splitfed.channel.server.trunkserver import TrunkServer

    with socket.socket() as probe:  # a port free now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    model = tiny_model("gpt2")
    server = trunk_server(split_model(model, (1, 3)).trunk, limits=LIMITS, bulk_connections=2, bulk_port=port)
    assert server.bulk.port == port
    with TrunkClient(server.address, insecure=True, limits=LIMITS, shared_memory="off", bulk_connections=2) as c:
        c.forward(CutState(torch.randn(2, 16, model.config.n_embd), None, None), train=False)
        assert c.bulk.calls == 1 and all(s.getpeername()[1] == port for s in c.bulk.link.socks)
    taken = TrunkServer(torch.nn.Linear(2, 2), insecure=True, bulk_connections=2, bulk_port=port)
    with pytest.raises(ConfigError, match="cannot listen"):
        taken.start()
    with pytest.raises(ConfigError, match="bulk_port"):
        TrunkServer(torch.nn.Linear(2, 2), insecure=True, bulk_connections=2, bulk_port=70000)


# -- what a hostile peer can do to the server ----------------------------------------------------------------
def _offer(address: str, client: str, connections: int = 2) -> pb.OpenBulkReply:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.SplitChannelStub(channel).OpenBulk(pb.OpenBulkRequest(connections=connections), timeout=10,
                                                          metadata=[(CLIENT_ID_KEY, client)])


def _refused(port: int, payload: bytes) -> bool:
    """Whether the server closes a connection that sends ``payload`` without answering it."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(payload)
        return _closed(sock)


def _frame(header: dict) -> bytes:
    return b"".join(pieces(header))


def _attach(port: int, ticket: bytes, indices: range | list[int]) -> list[socket.socket]:
    socks = []
    for index in indices:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        send_frame(sock, hello(ticket, index))
        assert recv_frame(sock, HELLO_LIMITS)[0] == bulk.ADMITTED
        socks.append(sock)
    return socks


def _serves(server) -> None:
    """The server still trains a bulk client: nothing a hostile peer did was lost on it."""
    client = TrunkClient(server.address, insecure=True, limits=LIMITS, shared_memory="off", bulk_connections=2)
    state = CutState(torch.randn(4, 16, 32), None, None)
    out, _ = client.forward(state, train=False)
    assert out.shape == state.hidden.shape and client.bulk.calls == 1
    client.close()


def test_handshakes_without_a_valid_ticket_are_refused(trunk_server) -> None:
    server = trunk_server(split_model(tiny_model("gpt2"), (1, 3)).trunk, limits=LIMITS, bulk_connections=2)
    port = server.bulk.port
    offer = _offer(server.address, "alice")
    assert offer.port == port and offer.connections == 2 and len(offer.ticket) == bulk.TICKET_BYTES
    assert _refused(port, b"GET / HTTP/1.1\r\n\r\n" + bytes(64))  # not a bulk connection
    assert _refused(port, _frame({**hello(offer.ticket, 0), "protocol": "splitfed-bulk/1"}))  # another version
    assert _refused(port, _frame({**hello(offer.ticket, 0), "ticket": "zz" * bulk.TICKET_BYTES}))  # not hex
    assert _refused(port, _frame({**hello(offer.ticket, 0), "index": "0"}))  # an index that is not a number
    assert _refused(port, _frame(hello(bytes(bulk.TICKET_BYTES), 0)))  # unknown ticket
    assert _refused(port, _frame(hello(offer.ticket, 2)))  # index past the link's connections
    socks = _attach(port, offer.ticket, [0])
    assert _refused(port, _frame(hello(offer.ticket, 0)))  # an index already attached
    socks += _attach(port, offer.ticket, [1])
    assert server.bulk.links == 1
    assert _refused(port, _frame(hello(offer.ticket, 1)))  # a used ticket
    for sock in socks:
        sock.close()
    _serves(server)


def test_a_link_of_another_client_is_refused(trunk_server) -> None:
    server = trunk_server(split_model(tiny_model("gpt2"), (1, 3)).trunk, limits=LIMITS, bulk_connections=2)
    offer = _offer(server.address, "alice")
    socks = _attach(server.bulk.port, offer.ticket, range(2))
    header = pb.Frame(forward_request=pb.ForwardRequest(activation_id="a", train=False))
    encs = encode_state(CutState(torch.randn(4, 16, 32), None, None), "fp32")
    next(frames(header, "forward_request", encs, 1))
    header.bulk.CopyFrom(pb.BulkRef(link=offer.link, transfer=1))
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.SplitChannelStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.ForwardStream(iter([header]), timeout=10, metadata=[(CLIENT_ID_KEY, "mallory")]))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # Alice's own call whose bytes never come: it ends at its deadline (the server's wait for the bytes ends
        # then too, whichever comes first), and the server holds nothing of it.
        with pytest.raises(grpc.RpcError) as info:
            list(stub.ForwardStream(iter([header]), timeout=0.5, metadata=[(CLIENT_ID_KEY, "alice")]))
        assert info.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
    (_, link), = server.bulk._links.values()
    deadline = time.monotonic() + 10
    while link._transfers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not link._transfers and link._pending == 0
    for sock in socks:
        sock.close()
    _serves(server)


def test_a_segment_off_its_stripe_closes_only_that_link(trunk_server, small_stripes: None) -> None:
    server = trunk_server(split_model(tiny_model("gpt2"), (1, 3)).trunk, limits=LIMITS, bulk_connections=2)
    offer = _offer(server.address, "mallory")
    socks = _attach(server.bulk.port, offer.ticket, range(2))
    _raw_segment(socks[1], 1, 4096, 0, 2048)  # connection 1 sends connection 0's stripe
    assert _closed(socks[1])
    deadline = time.monotonic() + 10
    while server.bulk.links and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.bulk.links == 0
    for sock in socks:
        sock.close()
    _serves(server)


# -- many calls at once ---------------------------------------------------------------------------------------
def test_calls_in_flight_at_once_share_links_and_get_their_own_replies(trunk_server, small_stripes: None) -> None:
    model = tiny_model("gpt2").eval()
    split = split_model(model, (1, 3))
    server = trunk_server(split.trunk, limits=LIMITS, bulk_connections=3)
    clients = [TrunkClient(server.address, insecure=True, limits=LIMITS, shared_memory="off", bulk_connections=3,
                           max_in_flight=8) for _ in range(3)]
    states = [CutState(torch.randn(4, 8 + i, 32), None, None) for i in range(24)]
    with torch.no_grad():
        want = [split.trunk(s).hidden for s in states]
    errors: list[BaseException] = []

    def run(client: TrunkClient, mine: list[int]) -> None:
        try:
            futures = [(i, client.submit(client.forward, states[i], train=False)) for i in mine]
            for i, future in futures:
                out, _ = future.result(60)
                assert torch.allclose(out, want[i], atol=1e-6, rtol=0), i
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c, list(range(k, 24, 3)))) for k, c in enumerate(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert [c.bulk.calls for c in clients] == [8, 8, 8], [c.bulk.failed for c in clients]
    assert server.bulk.links == 3
    for client in clients:
        client.close()



def test_slow_handshakes_chunks_after_a_bulk_header_and_too_many_links_are_refused(
        trunk_server, monkeypatch: pytest.MonkeyPatch) -> None:
    from splitfed.channel.transports.bulk import hub as bulkhub

    monkeypatch.setattr(bulkhub, "HANDSHAKE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(bulkhub, "MAX_LINKS_PER_CLIENT", 2)
    server = trunk_server(split_model(tiny_model("gpt2"), (1, 3)).trunk, limits=LIMITS, bulk_connections=2,
                          authenticate=lambda md: md.get("authorization", "") and "alice" or _no_token())
    with socket.create_connection(("127.0.0.1", server.bulk.port), timeout=10) as idle:
        start = time.monotonic()
        assert _closed(idle) and time.monotonic() - start < 5  # said nothing: dropped after the timeout
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.SplitChannelStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.OpenBulk(pb.OpenBulkRequest(connections=2), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        md = [("authorization", "Bearer t")]
        offers = [stub.OpenBulk(pb.OpenBulkRequest(connections=2), timeout=10, metadata=md) for _ in range(2)]
        with pytest.raises(grpc.RpcError) as info:
            stub.OpenBulk(pb.OpenBulkRequest(connections=2), timeout=10, metadata=md)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        socks = _attach(server.bulk.port, offers[0].ticket, range(2))
        header = pb.Frame(forward_request=pb.ForwardRequest(activation_id="a", train=False))
        encs = encode_state(CutState(torch.randn(4, 16, 32), None, None), "fp32")
        first, *chunks = frames(header, "forward_request", encs, 1000)
        chunked = [first] + [pb.Frame(chunk=pb.Chunk(offset=c.offset, data=bytes(c.data))) for c in chunks]
        chunked[0].bulk.CopyFrom(pb.BulkRef(link=offers[0].link, transfer=1))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.ForwardStream(iter(chunked), timeout=10, metadata=md))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "carries no chunks" in info.value.details()
    for sock in socks:
        sock.close()


def _no_token() -> str:
    from splitfed.errors import AuthError

    raise AuthError("missing authorization metadata")


def test_a_client_with_a_bulk_link_streams_mid_sized_tensors_over_it(trunk_server) -> None:
    # 320 KiB: a unary call under the default 4 MiB threshold, but above BULK_MIN_BYTES: over the link.
    split = split_model(tiny_model("gpt2").eval(), (1, 3))
    server = trunk_server(split.trunk, bulk_connections=2)
    state = CutState(torch.randn(64, 40, 32), None, None)
    assert 4 * state.hidden.numel() > bulk.BULK_MIN_BYTES
    with TrunkClient(server.address, insecure=True, shared_memory="off", bulk_connections=2) as client, \
            TrunkClient(server.address, insecure=True, shared_memory="off") as plain:
        out, _ = client.forward(state, train=False)
        want, _ = plain.forward(state, train=False)
        assert client.bulk.calls == 1 and plain.bulk.calls == 0 and torch.equal(out, want)
