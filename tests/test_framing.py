"""The stream protocol of every socket link (splitfed.channel.wire.framing, frameconn): frames, and what a reader refuses,
checked once here for blocking sockets and asyncio connections, then against each link's listener (bulk links,
direct calls, the front-ends' engine link): each closes a connection that sends a bad frame, and serves on."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import tempfile
import threading
import uuid
from collections.abc import AsyncIterator

import pytest
import torch
from torch import nn

from splitfed.channel.wire import frameconn
from splitfed.channel.wire import framing
from splitfed.channel.wire.framing import FrameError, FrameLimits, LinkClosed

LIMITS = FrameLimits(max_body=1 << 20, max_header=1 << 10)

# Frames a reader must refuse, by what is wrong with them; each closes the link.
BAD_FRAMES = {
    "header-above-limit": framing.LENGTHS.pack(1 << 30, 0) + b"{}",
    "body-above-limit": framing.LENGTHS.pack(2, 0xFFFFFFFF) + b"{}",  # above every link's limit
    "header-not-json": framing.LENGTHS.pack(5, 0) + b"{oops",
    "header-not-an-object": framing.LENGTHS.pack(2, 0) + b"[]",
    "header-not-utf8": framing.LENGTHS.pack(2, 0) + b"\xff\xfe",
    "not-a-frame": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
}
TRUNCATED = framing.LENGTHS.pack(2, 100) + b"{}" + bytes(40)  # then the peer closes


def _bytes(header: dict, parts: list[bytes] = ()) -> bytes:
    return b"".join(framing.pieces(header, parts))


# -- blocking sockets ---------------------------------------------------------------------------------------------
def test_frames_round_trip_over_a_blocking_socket_small_and_large() -> None:
    a, b = socket.socketpair()
    with a, b:
        payload = os.urandom(3 << 20)
        sent = threading.Thread(target=lambda: [framing.send_frame(a, {"id": i}, [payload[:n], payload[n:2 * n]])
                                                for i, n in enumerate((0, 10, 100_000, 1 << 20))])
        sent.start()
        for i, n in enumerate((0, 10, 100_000, 1 << 20)):
            header, body = framing.recv_frame(b, FrameLimits(4 << 20))
            assert header == {"id": i} and bytes(body) == payload[:2 * n]
        sent.join()
        a.shutdown(socket.SHUT_WR)
        assert framing.recv_head(b, LIMITS) is None  # closed between frames: the end, not an error


@pytest.mark.parametrize("case", sorted(BAD_FRAMES))
def test_a_blocking_reader_refuses_a_bad_frame(case: str) -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(BAD_FRAMES[case])
        with pytest.raises(FrameError):
            framing.recv_frame(b, LIMITS)


def test_a_frame_cut_short_is_a_closed_link_not_a_frame() -> None:
    a, b = socket.socketpair()
    with b:
        a.sendall(TRUNCATED)
        a.close()
        with pytest.raises(LinkClosed, match="after 42 of 102"):
            framing.recv_frame(b, LIMITS)


@pytest.mark.parametrize(("value", "ok"), [(3, True), (0, True), (-1, False), (True, False), (1.0, False),
                                           ("3", False), (None, False), (1 << 70, False)])
def test_integer_fields_are_integers_in_range(value: object, ok: bool) -> None:
    if ok:
        assert framing.int_field({"id": value}, "id") == value
    else:
        with pytest.raises(FrameError, match="'id' must be an integer"):
            framing.int_field({"id": value}, "id")


@pytest.mark.parametrize("sizes", [[1, 1], [-1, 4], ["3"], "3", [3, 1]])
def test_message_sizes_must_fill_the_body_exactly(sizes: object) -> None:
    with pytest.raises(FrameError, match="adding up"):
        framing.sizes_field({"parts": sizes}, 3)
    assert framing.split_body(b"abc", framing.sizes_field({"parts": [1, 0, 2]}, 3)) == [b"a", b"", b"bc"]


def test_string_fields_are_short_strings() -> None:
    assert framing.str_field({"t": "ab"}, "t") == "ab"
    for bad in ({"t": 1}, {}, {"t": "x" * 5000}):
        with pytest.raises(FrameError):
            framing.str_field(bad, "t")


def test_an_integer_header_round_trips_and_refuses_other_bytes() -> None:
    header = framing.IntHeader("transfer", "total", "offset")
    assert header.decode(bytearray(header.encode(7, 1 << 40, 3))) == (7, 1 << 40, 3)
    for bad in (b"", header.encode(1, 2, 3)[:-1], b"\x01" + header.encode(1, 2, 3)[1:], b'{"transfer":1}'):
        with pytest.raises(FrameError, match="not the"):
            header.decode(bad)
    a, b = socket.socketpair()
    with a, b:
        framing.send_frame(a, header.encode(1, 2, 3), [b"xy"])
        assert framing.recv_head(b, LIMITS, header) == ((1, 2, 3), 2)
        framing.recv_into(b, memoryview(bytearray(2)))  # the body
        framing.send_frame(a, {"transfer": 1, "pad": "x" * 20}, [b"xy"])  # a JSON header where integers are due
        with pytest.raises(FrameError, match="is not the 25-byte header"):
            framing.recv_head(b, LIMITS, header)


# -- asyncio connections ------------------------------------------------------------------------------------------
async def _echo_server(path: str, limits: FrameLimits, first: FrameLimits | None = None,
                       seen: list | None = None) -> asyncio.AbstractServer:
    async def echo(conn: frameconn.FrameConnection) -> None:
        try:
            while True:
                header, body = await conn.read()
                await conn.write(header, [body])
        except LinkClosed as exc:
            if seen is not None:
                seen.append(exc)
            conn.close()
    return await frameconn.serve_unix(path, limits, echo, first=first)


@contextlib.asynccontextmanager
async def _echo_link(limit: int) -> AsyncIterator[frameconn.FrameConnection]:
    """A connection to an echo server on a Unix socket in a scratch folder, both closed afterwards."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "s.sock")
        server = await _echo_server(path, FrameLimits(limit))
        conn = await frameconn.open_unix(path, FrameLimits(limit))
        try:
            yield conn
        finally:
            conn.close()
            server.close()
            await server.wait_closed()


def test_a_frame_connection_carries_small_frames_together_and_large_ones_into_their_own_buffer() -> None:
    sizes = [0, 1, 4096, 100_000, frameconn.SCRATCH_BYTES - 100, 3 << 20, 7, 1 << 20]

    async def scenario() -> None:
        async with _echo_link(8 << 20) as conn:
            payloads = [os.urandom(n) for n in sizes]
            for i, p in enumerate(payloads):  # all written before any is read: frames share reads
                await conn.write({"id": i, "pad": "x" * (i * 300)}, [p[: len(p) // 2], p[len(p) // 2:]])
            for i, p in enumerate(payloads):
                header, body = await conn.read()
                assert header["id"] == i and bytes(body) == p
            big_header = {"id": 99, "pad": "y" * (frameconn.SCRATCH_BYTES + 5)}  # grows the scratch buffer
            await conn.write(big_header, [b"z"])
            assert await conn.read() == (big_header, b"z")

    asyncio.run(scenario())


@pytest.mark.parametrize("case", [*sorted(BAD_FRAMES), "truncated", "body-before-hello"])
def test_a_frame_connection_refuses_a_bad_frame_and_closes(case: str) -> None:
    async def scenario() -> list:
        seen: list = []
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "s.sock")
            server = await _echo_server(path, LIMITS, first=framing.HELLO_LIMITS, seen=seen)
            reader, writer = await asyncio.open_unix_connection(path)
            if case == "body-before-hello":  # a first frame may carry no body: nothing is lent before a hello
                writer.write(_bytes({"hello": 1}, [b"x"]))
            elif case == "truncated":
                writer.write(_bytes({"hello": 1}) + TRUNCATED)
                writer.write_eof()
            else:
                writer.write(_bytes({"hello": 1}) + BAD_FRAMES[case])
            with pytest.raises(LinkClosed):  # the hello's echo may come first, or be cut off by the close
                for _ in range(2):
                    await asyncio.wait_for(framing.read_frame(reader, LIMITS), 10)
            writer.close()
            server.close()
            await server.wait_closed()
        return seen

    seen = asyncio.run(scenario())
    assert len(seen) == 1
    assert isinstance(seen[0], FrameError) == (case != "truncated")


def test_a_listening_connection_hands_each_frame_to_its_callback_in_order() -> None:
    """``listen``: frames that came before it first, then each as it is cut out (small ones together, a large one
    into its own buffer), in the order sent; ``read`` then waits for the link's end. The listener goes with the
    link, so nothing holds the connection in a cycle once it closed."""
    sizes = [5, frameconn.SCRATCH_BYTES - 100, 0, 3 << 20, 7]

    async def scenario() -> None:
        async with _echo_link(8 << 20) as conn:
            payloads = [os.urandom(n) for n in sizes]
            await conn.write({"id": 0}, [payloads[0]])
            while not conn._frames:  # the first echo arrives before anyone listens
                await asyncio.sleep(0.01)
            got: list = []
            all_in = asyncio.get_running_loop().create_future()

            def on_frame(frame: tuple) -> None:
                got.append((frame[0]["id"], bytes(frame[1])))
                if len(got) == len(sizes):
                    all_in.set_result(None)
            conn.listen(on_frame)
            assert got == [(0, payloads[0])]  # the frame that waited went first, at once
            for i, p in enumerate(payloads[1:], 1):
                await conn.write({"id": i}, [p])
            await asyncio.wait_for(all_in, 30)
            assert got == list(enumerate(payloads))
            reading = asyncio.ensure_future(conn.read())
            await asyncio.sleep(0.05)
            assert not reading.done()  # no frame is queued for a reader any more
            conn.close()
            with pytest.raises(LinkClosed):
                await asyncio.wait_for(reading, 10)
            assert conn._on_frame is None

    asyncio.run(scenario())


def test_a_listener_that_refuses_a_frame_closes_the_connection() -> None:
    """A :class:`FrameError` raised by the callback (a malformed id) ends the link as a malformed frame does."""
    async def scenario() -> None:
        async with _echo_link(1 << 20) as conn:
            seen: list = []

            def on_frame(frame: tuple) -> None:
                seen.append(frame[0])
                framing.int_field(frame[0], "id")  # raises for "x"
            conn.listen(on_frame)
            await conn.write({"id": 1}, [b"a"])
            await conn.write({"id": "x"}, [b"b"])
            with pytest.raises(FrameError, match="id"):
                await asyncio.wait_for(conn.read(), 10)
            assert [h["id"] for h in seen] == [1, "x"]
            await asyncio.wait_for(conn.closed.wait(), 10)

    asyncio.run(scenario())


# -- each link's listener ----------------------------------------------------------------------------------------
def _trunk() -> nn.Module:
    from splitfed.split import split_sequential

    torch.manual_seed(0)
    return split_sequential(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)), 1, 2)[1]


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(20)
    try:
        while sock.recv(65536):  # a listener may answer a hello before it refuses what follows
            pass
        return True
    except ConnectionResetError:
        return True


@pytest.fixture(scope="module")
def links() -> dict:
    """A trunk server with bulk links and direct calls and one with a front-end process (the two exclude each
    other), and clients that used them: one direct, one over a bulk link, one through the front-end."""
    from splitfed.channel.transports.shm import lane as shared
    from splitfed.channel.client.trunk import TrunkClient
    from splitfed.channel.wire.limits import ChannelLimits
    from splitfed.channel.server.trunkserver import TrunkServer
    from splitfed.split.base import CutState

    saved, shared.MIN_REGION_TENSOR_BYTES = shared.MIN_REGION_TENSOR_BYTES, 1  # the tiny tensors go by region
    server = TrunkServer(_trunk(), insecure=True, bulk_connections=2).start()
    fronted = TrunkServer(_trunk(), insecure=True, frontends=1).start()
    clients = {"direct": TrunkClient(server.address, insecure=True),
               "bulk": TrunkClient(server.address, insecure=True, shared_memory="off", bulk_connections=2,
                                   limits=ChannelLimits(stream_threshold_bytes=256)),
               "engine": TrunkClient(fronted.address, insecure=True, shared_memory="off")}
    for client in clients.values():
        client.forward(CutState(torch.randn(5, 16)), train=False)
    yield {"server": server, "fronted": fronted, **clients}
    for client in clients.values():
        client.close()
    server.stop(grace=0)
    fronted.stop(grace=0)
    shared.MIN_REGION_TENSOR_BYTES = saved


def _connect(links: dict, link: str, admitted: bool = False) -> socket.socket:
    """A raw connection to ``link``'s listener; ``admitted``: its hello sent (the ticket, the secret) first."""
    if link == "bulk":
        return socket.create_connection(("127.0.0.1", links["server"].bulk.port), timeout=20)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if link == "direct":
        direct = links["direct"].shared.region.direct
        sock.connect(direct.path)
        if admitted:
            framing.send_frame(sock, {"ticket": direct.ticket})
            assert framing.recv_frame(sock, framing.HELLO_LIMITS)[0] == {"admitted": True}
    else:
        listener = links["fronted"].frontends.listener
        sock.connect(listener.path)
        if admitted:
            framing.send_frame(sock, {"secret": listener.secret})
    return sock


def _serves(links: dict) -> None:
    """Every client is still served the trunk's output, the direct one directly, the bulk one over its link."""
    from splitfed.split.base import CutState

    x = torch.randn(5, 16)
    with torch.no_grad():
        want = links["server"].runtime.trunk(CutState(x)).hidden
    direct, bulk = links["direct"].shared.direct_calls, links["bulk"].bulk.calls
    for name in ("direct", "bulk", "engine"):
        out, _ = links[name].forward(CutState(x), train=False)
        assert torch.allclose(out, want, atol=1e-6), name
    assert links["direct"].shared.direct_calls == direct + 1 and links["bulk"].bulk.calls == bulk + 1


@pytest.mark.parametrize("case", [*sorted(BAD_FRAMES), "truncated"])
@pytest.mark.parametrize("link", ["bulk", "direct", "engine", "direct-admitted", "engine-admitted"])
def test_every_link_closes_a_connection_that_sends_a_bad_frame_and_serves_on(links: dict, link: str,
                                                                           case: str) -> None:
    """As its first frame (its hello), or after a hello that admitted it."""
    with _connect(links, link.removesuffix("-admitted"), link.endswith("-admitted")) as sock:
        if case == "truncated":
            sock.sendall(TRUNCATED)
            with contextlib.suppress(OSError):  # a first frame with a body: the listener may have closed already
                sock.shutdown(socket.SHUT_WR)
        else:
            sock.sendall(BAD_FRAMES[case])
        assert _closed(sock)
    _serves(links)


def test_a_frame_with_an_id_that_is_not_a_number_closes_the_engine_link_connection(links: dict) -> None:
    listener = links["fronted"].frontends.listener
    calls = listener.stats["calls"]
    with _connect(links, "engine") as sock:
        framing.send_frame(sock, {"secret": listener.secret})
        framing.send_frame(sock, {"id": "1; drop", "method": "/x"})
        assert _closed(sock)
    assert listener.stats["calls"] == calls  # nothing ran
    _serves(links)


def test_an_unknown_transfer_id_holds_no_more_than_the_links_limits(links: dict) -> None:
    """A segment for a transfer nobody announced is a new transfer, bounded by the link's byte limits: one above
    them closes the link before anything is allocated."""
    from splitfed.channel.transports.bulk import links as bulk

    allocated: list[int] = []

    def alloc(n: int) -> bytearray:
        allocated.append(n)
        return bytearray(n)

    a, b = socket.socketpair()
    with a, b:
        link = bulk.BulkLink(uuid.uuid4().hex, [b], alloc=alloc, max_bytes=1 << 20).start()
        head = bulk.segment(12345, 2 << 20, 0)
        a.sendall(framing.LENGTHS.pack(len(head), 2 << 20) + head)  # a stripe above the largest transfer
        assert _closed(a) and link.closed is not None and "above this end's limits" in link.closed
    assert allocated == []
