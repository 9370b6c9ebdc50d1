"""bench.stream_protocol runs: its splitfed variants echo a payload between two processes (pyzmq's only where it is
installed)."""

from __future__ import annotations

from bench import stream_protocol


def test_the_stream_protocol_bench_times_each_variant() -> None:
    variants = ["streams-asyncio-ipc", "frames-asyncio-ipc", "frames-blocking-ipc", "frames-blocking-tcp"]
    result = stream_protocol.measure(variants, [4096, 300_000], reps=20, blocks=2)
    assert set(result) == set(variants)
    assert all(0 < us < 5e6 for sizes in result.values() for us in sizes.values())
