"""The floor under the socket path: one large tensor's bytes echoed over loopback by Python gRPC, and by a raw TCP
socket, in one run.

A split step over the socket moves the cut's activation and gradient four times (GPT-2 small at 16 x 512
positions in bf16: 12.6 MB each way). Whatever the channel does, it cannot move those bytes faster than the
transport beneath it. This bench times, for one payload size, an echo round trip (median over ``repeat``):

* ``transport_grpc_unary_ms``: one unary call carrying the whole payload (message limits raised);
* ``transport_grpc_stream_ms``: a stream-stream call in 1 MiB chunks (what the channel does above its
  ``stream_threshold_bytes``);
* ``transport_grpc_channels4_ms``: the payload cut in 4 parts, sent at once as unary calls over 4 channels
  (4 TCP connections);
* ``transport_tcp_ms`` / ``transport_tcp_conns4_ms``: a raw TCP socket (``sendall`` of the bytes, ``recv_into``
  a buffer allocated once), on 1 connection and on 4 at once;
* ``transport_bulk_link4_ms``: splitfed's bulk link (:mod:`splitfed.channel.transports.bulk.links`) of 4 connections, the
  payload striped over them each way, read into a buffer of the receiver's own (what a streamed call's bytes take
  with ``bulk_connections = 4``);
* ``transport_grpc_stream_vs_tcp``: the streamed gRPC echo over the single TCP connection's;
  ``transport_bulk_vs_grpc_stream``: the bulk link's echo over the streamed gRPC echo.

Servers run in processes of their own (``spawn``) on 127.0.0.1; the raw TCP echo is a loopback bench server only.
``channel_vs_grpc_ratio_*`` (``python -m bench --only channel``) compares the split channel itself with a gRPC echo.

    python -m bench.transport [--mib 12] [--repeat 15] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from bench.core import print_results
from bench.processes import BenchError, end_children, get_from

CHUNK = 1 << 20
LIMITS = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]
_HEADER = 8


def _serve_grpc(port_queue: Any) -> None:
    """A ``grpc.aio`` echo server: ``/bench.Echo/Unary`` and ``/bench.Echo/Stream`` return what they get."""
    async def main() -> None:
        server = grpc.aio.server(options=LIMITS)

        async def unary(request: bytes, context: Any) -> bytes:
            return request

        async def stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
            async for chunk in requests:
                yield chunk

        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.stream_stream_rpc_method_handler(stream)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_queue.put(port)
        await server.wait_for_termination()

    asyncio.run(main())


def _echo_connection(conn: socket.socket, max_bytes: int) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(max_bytes))
    with conn:
        while True:
            header = conn.recv(_HEADER, socket.MSG_WAITALL)
            if len(header) < _HEADER:
                return
            n = int.from_bytes(header, "little")
            if n > max_bytes:
                return
            got = 0
            while got < n:
                k = conn.recv_into(buf[got:n])
                if not k:
                    return
                got += k
            conn.sendall(header)
            conn.sendall(buf[:n])


def _serve_tcp(port_queue: Any, max_bytes: int) -> None:
    """A raw TCP echo: an 8-byte little-endian length, then that many bytes, sent back as they came."""
    listener = socket.create_server(("127.0.0.1", 0))
    port_queue.put(listener.getsockname()[1])
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_echo_connection, args=(conn, max_bytes), daemon=True).start()


def _serve_bulk(port_queue: Any, nbytes: int, connections: int) -> None:
    """A bulk link echo: ``connections`` connections (each first sends its index, one byte) make one link; transfer
    i comes back as transfer i."""
    from splitfed.channel.transports.bulk.links import BulkLink, tune

    listener = socket.create_server(("127.0.0.1", 0))
    port_queue.put(listener.getsockname()[1])
    socks: list[socket.socket | None] = [None] * connections
    for _ in range(connections):
        conn, _ = listener.accept()
        tune(conn)
        socks[conn.recv(1)[0]] = conn
    link = BulkLink("echo", [s for s in socks if s is not None], max_bytes=nbytes).start()
    transfer = 0
    while link.closed is None:
        transfer += 1
        try:
            buf = link.take(transfer, nbytes, timeout=None)
            for future in link.send(transfer, [memoryview(buf)], nbytes):
                future.result()
        except Exception:  # noqa: BLE001 - the client went away: the echo ends
            return


def _bulk_client(port: int, nbytes: int, connections: int) -> Any:
    from splitfed.channel.transports.bulk.links import BulkLink, tune

    socks = []
    for index in range(connections):
        sock = socket.create_connection(("127.0.0.1", port))
        tune(sock)
        sock.sendall(bytes([index]))
        socks.append(sock)
    return BulkLink("echo", socks, max_bytes=nbytes).start()


class _TcpClient:
    def __init__(self, port: int, max_bytes: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = memoryview(bytearray(max_bytes))

    def echo(self, payload: memoryview) -> int:
        n = len(payload)
        self.sock.sendall(n.to_bytes(_HEADER, "little"))
        self.sock.sendall(payload)
        if len(self.sock.recv(_HEADER, socket.MSG_WAITALL)) < _HEADER:
            raise BenchError("the TCP echo server closed the connection")
        got = 0
        while got < n:
            k = self.sock.recv_into(self.buf[got:n])
            if not k:
                raise BenchError("the TCP echo server closed the connection mid-reply")
            got += k
        return got


def _median_ms(fn: Callable[[], int], expect: int, repeat: int) -> float:
    times = []
    for i in range(repeat + 2):
        start = time.perf_counter()
        got = fn()
        elapsed = time.perf_counter() - start
        if got != expect:
            raise BenchError(f"an echo returned {got} bytes of {expect}")
        if i >= 2:  # two warm-up round trips
            times.append(elapsed)
    return statistics.median(times) * 1e3


def _parts(data: bytes, k: int) -> list[memoryview]:
    step = -(-len(data) // k)
    view = memoryview(data)
    return [view[i:i + step] for i in range(0, len(data), step)]


def transport(nbytes: int = 12_582_912, repeat: int = 15) -> dict[str, float]:
    """Echo round trips of ``nbytes`` over loopback: Python gRPC (unary, streamed, 4 channels) and raw TCP."""
    ctx = mp.get_context("spawn")
    grpc_port, tcp_port, bulk_port = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_serve_grpc, args=(grpc_port,), daemon=True),
             ctx.Process(target=_serve_tcp, args=(tcp_port, nbytes), daemon=True),
             ctx.Process(target=_serve_bulk, args=(bulk_port, nbytes, 4), daemon=True)]
    for p in procs:
        p.start()
    pool = ThreadPoolExecutor(4)
    channels: list[grpc.Channel] = []
    link = None
    try:
        gport = get_from(grpc_port, procs, 60, "the gRPC echo server's port")
        tport = get_from(tcp_port, procs, 60, "the TCP echo server's port")
        data = os.urandom(nbytes)
        options = LIMITS + [("grpc.use_local_subchannel_pool", 1)]  # a TCP connection of its own each
        channels = [grpc.insecure_channel(f"127.0.0.1:{gport}", options=options) for _ in range(4)]
        unary = [c.unary_unary("/bench.Echo/Unary") for c in channels]
        stream = channels[0].stream_stream("/bench.Echo/Stream")
        tcp = [_TcpClient(tport, nbytes) for _ in range(4)]
        link = _bulk_client(get_from(bulk_port, procs, 60, "the bulk link echo's port"), nbytes, 4)
        transfers = iter(range(1, 1 << 30))

        def bulk_echo() -> int:
            transfer = next(transfers)
            sent = link.send(transfer, [memoryview(data)], nbytes)
            got = len(link.take(transfer, nbytes, timeout=60))
            for future in sent:
                future.result()
            return got

        def streamed() -> int:
            chunks = (data[i:i + CHUNK] for i in range(0, nbytes, CHUNK))
            return sum(len(r) for r in stream(chunks))

        def grpc_parallel() -> int:
            calls = [pool.submit(unary[i], bytes(part)) for i, part in enumerate(_parts(data, 4))]
            return sum(len(c.result()) for c in calls)

        def tcp_parallel() -> int:
            calls = [pool.submit(tcp[i].echo, part) for i, part in enumerate(_parts(data, 4))]
            return sum(c.result() for c in calls)

        out = {
            "transport_grpc_unary_ms": _median_ms(lambda: len(unary[0](data)), nbytes, repeat),
            "transport_grpc_stream_ms": _median_ms(streamed, nbytes, repeat),
            "transport_grpc_channels4_ms": _median_ms(grpc_parallel, nbytes, repeat),
            "transport_tcp_ms": _median_ms(lambda: tcp[0].echo(memoryview(data)), nbytes, repeat),
            "transport_tcp_conns4_ms": _median_ms(tcp_parallel, nbytes, repeat),
            "transport_bulk_link4_ms": _median_ms(bulk_echo, nbytes, repeat),
        }
        out["transport_grpc_stream_vs_tcp"] = out["transport_grpc_stream_ms"] / out["transport_tcp_ms"]
        out["transport_bulk_vs_grpc_stream"] = out["transport_bulk_link4_ms"] / out["transport_grpc_stream_ms"]
        out["transport_bytes"] = float(nbytes)
        return out
    finally:
        if link is not None:
            link.close()
        for c in channels:
            c.close()
        pool.shutdown(wait=False)
        for p in procs:  # echo servers with nothing to finish: told to stop at once
            p.terminate()
        end_children(procs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=12.0, help="payload size in MiB (default 12: 12.6 MB)")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        results = transport(int(args.mib * (1 << 20)), args.repeat)
    except BenchError as exc:
        print(f"bench.transport failed: {exc}", file=sys.stderr)
        return 1
    print_results(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
