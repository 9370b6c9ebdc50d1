"""The stream protocol's floor: round trips of one framed message (a JSON header and a payload) echoed between two
processes, over a Unix socket (ipc) and loopback TCP, by splitfed's framing and, when it is installed, by pyzmq.

``python -m bench.stream_protocol`` prints, for each payload size (``--sizes``, default 4 KiB and 1 MiB) and each
variant, the median round trip in microseconds over ``--reps`` calls (after a warm-up), the variants alternating
block by block so that load from elsewhere falls on all alike:

* ``streams-asyncio-ipc``: asyncio's streams at both ends (the front-end-to-engine link before
  :mod:`splitfed.channel.wire.frameconn`), ``frames-asyncio-ipc``: :class:`~splitfed.channel.wire.frameconn.FrameConnection`
  at both ends (the link now);
* ``streams-blocking-ipc``: a blocking socket against an asyncio-streams server (the direct calls before),
  ``frames-blocking-ipc``: against a ``FrameConnection`` server (the direct calls now);
* ``frames-blocking-tcp``: blocking sockets at both ends over TCP (what a bulk link's connection does);
* ``zmq-asyncio-ipc``, ``zmq-blocking-ipc``, ``zmq-blocking-tcp``: the same three with pyzmq (DEALER to ROUTER,
  multipart ``[header, payload]`` sent with ``copy=False``), when ``import zmq`` works.

The echo server sends back the header and the payload it received; the client checks the payload's length.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from splitfed.channel.wire import frameconn
from splitfed.channel.wire import framing

VARIANTS = ("streams-asyncio-ipc", "frames-asyncio-ipc", "streams-blocking-ipc", "frames-blocking-ipc", "frames-blocking-tcp", "zmq-asyncio-ipc", "zmq-blocking-ipc",
            "zmq-blocking-tcp")
MAX_BODY = 64 << 20
LIMITS = framing.FrameLimits(max_body=MAX_BODY)


def has_zmq() -> bool:
    """Whether pyzmq is importable here."""
    try:
        import zmq  # noqa: F401
    except ImportError:
        return False
    return True


# -- servers (each in a process of its own) ---------------------------------------------------------------------
async def _frames_server(path: str, port_q: Any, tcp: bool) -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                header, body = await framing.read_frame(reader, LIMITS)
                await framing.write_frame(writer, header, [body])
        except framing.LinkClosed:
            writer.close()

    if tcp:
        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        port_q.put(server.sockets[0].getsockname()[1])
    else:
        server = await asyncio.start_unix_server(echo, path=path)
        port_q.put(0)
    async with server:
        await server.serve_forever()


async def _frameconn_server(path: str, port_q: Any) -> None:
    async def echo(conn: frameconn.FrameConnection) -> None:
        try:
            while True:
                header, body = await conn.read()
                await conn.write(header, [body])
        except framing.LinkClosed:
            conn.close()

    server = await frameconn.serve_unix(path, LIMITS, echo)
    port_q.put(0)
    async with server:
        await server.serve_forever()


def _frames_blocking_tcp_server(port_q: Any) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port_q.put(listener.getsockname()[1])
    while True:
        sock, _ = listener.accept()
        framing.tune(sock)

        def serve(s: socket.socket = sock) -> None:
            try:
                while True:
                    header, body = framing.recv_frame(s, LIMITS)
                    framing.send_frame(s, header, [body])
            except (framing.LinkClosed, OSError):
                s.close()
        threading.Thread(target=serve, daemon=True).start()


async def _zmq_asyncio_server(address: str, port_q: Any) -> None:
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1") if address == "tcp" else (sock.bind(address), 0)[1]
    port_q.put(port)
    while True:
        msg = await sock.recv_multipart(copy=False)
        await sock.send_multipart(msg, copy=False)


def _zmq_blocking_server(port_q: Any) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port_q.put(sock.bind_to_random_port("tcp://127.0.0.1"))
    while True:
        sock.send_multipart(sock.recv_multipart(copy=False), copy=False)


def _serve(variant: str, path: str, port_q: Any) -> None:
    if variant in ("streams-asyncio-ipc", "streams-blocking-ipc"):
        asyncio.run(_frames_server(path, port_q, tcp=False))
    elif variant in ("frames-asyncio-ipc", "frames-blocking-ipc"):
        asyncio.run(_frameconn_server(path, port_q))
    elif variant == "frames-blocking-tcp":
        _frames_blocking_tcp_server(port_q)
    elif variant in ("zmq-asyncio-ipc", "zmq-blocking-ipc"):
        asyncio.run(_zmq_asyncio_server(f"ipc://{path}", port_q))
    elif variant == "zmq-blocking-tcp":
        _zmq_blocking_server(port_q)
    else:
        raise ValueError(variant)


# -- clients ----------------------------------------------------------------------------------------------------
Timer = Callable[[int], list[float]]


def _frames_asyncio_client(path: str, payload: bytes) -> Timer:
    loop = asyncio.new_event_loop()
    reader, writer = loop.run_until_complete(asyncio.open_unix_connection(path))

    async def run(n: int) -> list[float]:
        out = []
        for i in range(n):
            t = time.perf_counter()
            await framing.write_frame(writer, {"id": i, "method": "/echo"}, [payload])
            _, body = await framing.read_frame(reader, LIMITS)
            out.append(time.perf_counter() - t)
            assert len(body) == len(payload)
        return out
    return lambda n: loop.run_until_complete(run(n))


def _frameconn_client(path: str, payload: bytes) -> Timer:
    loop = asyncio.new_event_loop()
    conn = loop.run_until_complete(frameconn.open_unix(path, LIMITS))

    async def run(n: int) -> list[float]:
        out = []
        for i in range(n):
            t = time.perf_counter()
            await conn.write({"id": i, "method": "/echo"}, [payload])
            _, body = await conn.read()
            out.append(time.perf_counter() - t)
            assert len(body) == len(payload)
        return out
    return lambda n: loop.run_until_complete(run(n))


def _frames_blocking_client(address: str | tuple[str, int], payload: bytes) -> Timer:
    sock = socket.socket(socket.AF_UNIX if isinstance(address, str) else socket.AF_INET, socket.SOCK_STREAM)
    sock.connect(address)
    framing.tune(sock)

    def run(n: int) -> list[float]:
        out = []
        for i in range(n):
            t = time.perf_counter()
            framing.send_frame(sock, {"id": i, "method": "/echo"}, [payload])
            _, body = framing.recv_frame(sock, LIMITS)
            out.append(time.perf_counter() - t)
            assert len(body) == len(payload)
        return out
    return run


def _zmq_asyncio_client(address: str, payload: bytes) -> Timer:
    import zmq
    import zmq.asyncio

    loop = asyncio.new_event_loop()
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.connect(address)

    async def run(n: int) -> list[float]:
        out = []
        for i in range(n):
            t = time.perf_counter()
            await sock.send_multipart([json.dumps({"id": i, "method": "/echo"}).encode(), payload], copy=False)
            head, body = await sock.recv_multipart(copy=False)
            json.loads(head.bytes)
            out.append(time.perf_counter() - t)
            assert len(body.buffer) == len(payload)
        return out
    return lambda n: loop.run_until_complete(run(n))


def _zmq_blocking_client(address: str, payload: bytes) -> Timer:
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(address)

    def run(n: int) -> list[float]:
        out = []
        for i in range(n):
            t = time.perf_counter()
            sock.send_multipart([json.dumps({"id": i, "method": "/echo"}).encode(), payload], copy=False)
            head, body = sock.recv_multipart(copy=False)
            json.loads(head.bytes)
            out.append(time.perf_counter() - t)
            assert len(body.buffer) == len(payload)
        return out
    return run


def _client(variant: str, path: str, port: int, payload: bytes) -> Timer:
    if variant == "streams-asyncio-ipc":
        return _frames_asyncio_client(path, payload)
    if variant == "frames-asyncio-ipc":
        return _frameconn_client(path, payload)
    if variant in ("streams-blocking-ipc", "frames-blocking-ipc"):
        return _frames_blocking_client(path, payload)
    if variant == "frames-blocking-tcp":
        return _frames_blocking_client(("127.0.0.1", port), payload)
    if variant == "zmq-asyncio-ipc":
        return _zmq_asyncio_client(f"ipc://{path}", payload)
    if variant == "zmq-blocking-ipc":
        return _zmq_blocking_client(f"ipc://{path}", payload)
    return _zmq_blocking_client(f"tcp://127.0.0.1:{port}", payload)


def measure(variants: list[str], sizes: list[int], reps: int, blocks: int = 5) -> dict[str, dict[int, float]]:
    """Median round trip (microseconds) of each variant and payload size; variants alternate block by block."""
    ctx = mp.get_context("spawn")
    folder = tempfile.mkdtemp(prefix="splitfed-stream-bench-")
    procs, timers = [], {}
    try:
        for variant in variants:
            path = os.path.join(folder, f"{variant}.sock")
            port_q = ctx.Queue()
            proc = ctx.Process(target=_serve, args=(variant, path, port_q), daemon=True)
            proc.start()
            procs.append(proc)
            port = port_q.get(timeout=60)
            for size in sizes:
                timers[(variant, size)] = _client(variant, path, port, os.urandom(size))
        times: dict[tuple[str, int], list[float]] = {key: [] for key in timers}
        for key, timer in timers.items():
            timer(max(reps // 10, 5))  # warm-up
        per_block = max(reps // blocks, 1)
        for _ in range(blocks):
            for key, timer in timers.items():
                times[key] += timer(per_block)
        return {v: {s: statistics.median(times[(v, s)]) * 1e6 for s in sizes} for v in variants}
    finally:
        for proc in procs:
            proc.terminate()
            proc.join(5)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the comparison and print its table (``--json``: one JSON object)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="*", type=int, default=[4 << 10, 1 << 20])
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--variants", nargs="*", choices=VARIANTS, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    variants = args.variants or [v for v in VARIANTS if has_zmq() or not v.startswith("zmq")]
    result = measure(variants, args.sizes, args.reps)
    out = {"rtt_us": {v: {str(s): round(t, 1) for s, t in r.items()} for v, r in result.items()},
           "sizes": args.sizes, "reps": args.reps, "cpus": os.cpu_count()}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{'variant':<22}" + "".join(f"{f'{s} B (us)':>16}" for s in args.sizes))
        for v, r in result.items():
            print(f"{v:<22}" + "".join(f"{r[s]:>16.1f}" for s in args.sizes))
    return out


if __name__ == "__main__":
    main()
