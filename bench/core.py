"""Benchmarks of the split core, each a ratio of two things measured side by side in one run.

* ``split_step_ratio`` (:mod:`bench.split_step`): one training step of a tiny GPT-2 (6 layers, hidden 256,
  vocab 8192, seq 128, batch 8) split over the real channel on loopback,
  divided by the same unsplit step (``_process``: trunk server in its own process).
  ``split_step_shared_fraction`` is the share of the cut's bytes that went through
  a shared-memory region, ``split_step_gpu_copy_fraction`` the share of calls whose
  copies went device to device through the region's GPU memory; on a GPU,
  ``split_step_host_syncs`` and ``unsplit_step_host_syncs`` the host's reads of the
  device in one step of each (:mod:`bench.host_syncs`).
* ``channel_vs_grpc_ratio_{1,16}MiB``: a channel Forward round trip (identity
  trunk, evaluation forward: decode, check, encode) divided by a bare gRPC
  unary echo of the same bytes.
* ``codec_speedup_vs_repeated_float``: encode + serialize + parse + decode of a
  4 MiB fp32 tensor as a packed protobuf ``repeated float``, divided by the same
  through splitfed's codec.
* ``compression_bytes_ratio_{int8,topk}``: bytes at the cut per training step of
  the split-step model uncompressed, divided by the same with int8 activations and
  gradients (``topk``: int8 activations, top-k gradients); ``compression_step_ratio_*``
  the step times likewise (compressed / uncompressed).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import torch

from bench.processes import check_alive, end_children, get_from

MiB = 1 << 20


def print_results(results: dict[str, Any], as_json: bool) -> None:
    """Print a bench's results: one JSON object, or one aligned ``key  value`` line each."""
    import json

    if as_json:
        print(json.dumps(results, sort_keys=True))
        return
    width = max(len(k) for k in results)
    for key, value in results.items():
        print(f"{key:<{width}}  {value:.4g}" if isinstance(value, float) else f"{key:<{width}}  {value}")


def timeit(fn: Callable[[], object], repeat: int, warmup: int = 2) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved(a: Callable[[], object], b: Callable[[], object], repeat: int, warmup: int = 2) -> tuple[float, float]:
    """Median seconds of ``a`` and ``b``, run alternately so that machine noise hits both alike."""
    for _ in range(warmup):
        a()
        b()
    ta, tb = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        a()
        ta.append(time.perf_counter() - start)
        start = time.perf_counter()
        b()
        tb.append(time.perf_counter() - start)
    return statistics.median(ta), statistics.median(tb)


# -- split step -------------------------------------------------------------------
#: The split-step model and batch; ``python -m bench --split-config "layers=12 hidden=768 ..."`` changes them.
SPLIT_STEP: dict[str, int] = {"layers": 6, "hidden": 256, "heads": 4, "vocab": 8192, "batch": 8, "seq": 128,
                              "bf16": 0}


def set_split_step(config: str, option: str = "--config") -> None:
    """Set :data:`SPLIT_STEP` from ``"key=value ..."`` (a bench's ``option``); raises ValueError saying what is
    wrong (a command passes it to ``parser.error``)."""
    for item in config.split():
        key, _, value = item.partition("=")
        if key not in SPLIT_STEP:
            raise ValueError(f"{option}: unknown key {key!r}; known: {', '.join(SPLIT_STEP)}")
        if not value.isdigit():
            raise ValueError(f"{option}: {item!r} needs an integer value, as {key}=4")
        SPLIT_STEP[key] = int(value)


def _gpt2(seed: int = 0) -> torch.nn.Module:
    from transformers import GPT2LMHeadModel

    from splitfed.models.catalog import tiny_gpt2_config

    torch.manual_seed(seed)
    c = SPLIT_STEP
    return GPT2LMHeadModel(tiny_gpt2_config(c["vocab"], layers=c["layers"], hidden=c["hidden"], heads=c["heads"],
                                            positions=c["seq"])).train()


def _cuts() -> tuple[int, int]:
    n = SPLIT_STEP["layers"]
    return n // 3, n - n // 3


# -- channel vs bare gRPC -------------------------------------------------------------
CHANNEL_LIMITS = dict(max_message_bytes=64 * MiB, stream_threshold_bytes=4 * MiB, chunk_bytes=1 * MiB,
                      max_tensor_bytes=256 * MiB)


def _serve_echo_and_identity(port_queue: Any, stop: Any) -> None:
    """The servers of the comparison, in one process apart from the clients (as on a real network).

    A bare echo (gRPC's sync server, no options), the trunk server (identity trunk), and an echo served the
    way the trunk server serves its calls (``grpc.aio``, its options, health, reflection, concurrency limit;
    see :func:`_start_configured_echo`)."""
    import asyncio
    import threading

    import grpc

    from splitfed.channel.server.trunkserver import ChannelLimits, TrunkServer
    from splitfed.split.sequential import split_sequential
    from splitfed.tuning import tune_malloc

    tune_malloc()
    limits = ChannelLimits(**CHANNEL_LIMITS)
    echo_server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=limits.grpc_options())
    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)})
    echo_server.add_generic_rpc_handlers((handler,))
    echo_port = echo_server.add_insecure_port("127.0.0.1:0")
    echo_server.start()
    _, identity, _ = split_sequential(torch.nn.Sequential(torch.nn.Identity(), torch.nn.Identity(),
                                                          torch.nn.Identity()), 1, 2)
    trunk = TrunkServer(identity, insecure=True, limits=limits).start()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True, name="configured-echo").start()
    configured, configured_port = asyncio.run_coroutine_threadsafe(_start_configured_echo(limits), loop).result(60)
    port_queue.put((echo_port, trunk.port, configured_port))
    stop.wait()
    asyncio.run_coroutine_threadsafe(configured.stop(0), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    trunk.stop(grace=0)
    echo_server.stop(0)


#: The configured echo's method: under the channel's service name, so that a trunk client's retry policy
#: (declared for that service) applies to it.
CONFIGURED_ECHO = "BenchEcho"


async def _start_configured_echo(limits: Any) -> tuple[Any, int]:
    """An echo on a ``grpc.aio`` server built as the trunk server builds its own (:func:`start_grpc_server`)."""
    import grpc
    from grpc_health.v1 import health

    from splitfed.channel.wire.limits import SERVICE_NAME
    from splitfed.channel.server.listeners import start_grpc_server

    async def echo(request: bytes, context: Any) -> bytes:
        return request

    handler = grpc.method_handlers_generic_handler(
        SERVICE_NAME, {CONFIGURED_ECHO: grpc.unary_unary_rpc_method_handler(echo)})
    return await start_grpc_server((handler,), health.aio.HealthServicer(), host="127.0.0.1", port=0,
                                   credentials=None, limits=limits, interceptors=[], max_concurrent_rpcs=4096,
                                   reuse_port=False)


_SIZE_NAMES = {4 << 10: "4KiB", 1 << 20: "1MiB", 16 << 20: "16MiB"}


def channel_vs_grpc(sizes: tuple[int, ...] = (4 << 10, 1 << 20, 16 << 20), repeat: int = 30) -> dict[str, float]:
    """Channel Forward round trip / bare gRPC echo of the same bytes, per payload size.

    The channel's server decodes and checks the tensor (NaN/Inf), runs an
    identity trunk and encodes the reply; the echo server returns the request
    bytes. Both servers run in one process, the clients in another.
    ``channel_vs_grpc_ratio_*`` sends the bytes over the socket as the echo does
    (``shared_memory="off"``); ``channel_shared_vs_grpc_ratio_*`` (sizes of 64 KiB
    and more) lets them go through a shared-memory region, as a client on the
    trunk's host does by default.
    ``channel_direct_vs_grpc_ratio_4KiB``: 4 KiB calls of a client on the trunk's
    host once its region is open, which go inline over the region's direct-call
    link instead of gRPC.

    The ratio splits in two factors, measured in the same run:
    ``grpc_configured_echo_ratio_*`` is an echo called and served as the channel's
    calls are (a trunk client's channel with its retry policy, deadline and
    metadata; a ``grpc.aio`` server built as the trunk server's) over the bare echo:
    what gRPC costs configured so. ``channel_vs_configured_echo_ratio_*`` is the
    channel over that echo: what splitfed's own code costs per call.
    """
    import grpc

    from splitfed.channel.client.trunk import TrunkClient
    from splitfed.channel.server.trunkserver import ChannelLimits
    from splitfed.split import CutState

    limits = ChannelLimits(**CHANNEL_LIMITS)
    ctx = mp.get_context("spawn")
    port_queue, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_serve_echo_and_identity, args=(port_queue, stop), daemon=True)
    proc.start()
    out: dict[str, float] = {}
    try:
        echo_port, trunk_port, configured_port = get_from(port_queue, [proc], 120,
                                                          "the echo and trunk servers' ports")
        echo_channel = grpc.insecure_channel(f"127.0.0.1:{echo_port}", options=limits.grpc_options())
        echo = echo_channel.unary_unary("/bench.Echo/Echo")
        address = f"127.0.0.1:{trunk_port}"
        client = TrunkClient(address, insecure=True, limits=limits, shared_memory="off")
        shared = TrunkClient(address, insecure=True, limits=limits, shared_memory="on")
        # A trunk client pointed at the configured echo: its channel options, deadline and metadata per call.
        configured = TrunkClient(f"127.0.0.1:{configured_port}", insecure=True, limits=limits,
                                 shared_memory="off")
        configured_echo = configured.raw_unary(CONFIGURED_ECHO)
        for size in sizes:
            name = _SIZE_NAMES.get(size, f"{size}B")
            hidden = torch.randn(size // 4 // 256, 256)
            payload = hidden.numpy().tobytes()
            state = CutState(hidden)
            n = repeat * (10 if size < MiB else 1)
            t_channel, t_echo = interleaved(lambda: client.forward(state, train=False), lambda: echo(payload), n,
                                            warmup=3)
            out[f"channel_vs_grpc_ratio_{name}"] = t_channel / t_echo
            out[f"channel_rtt_{name}_ms"] = t_channel * 1e3
            out[f"grpc_echo_rtt_{name}_ms"] = t_echo * 1e3
            t_configured, t_bare = interleaved(lambda: configured_echo(payload), lambda: echo(payload), n, warmup=3)
            out[f"grpc_configured_echo_ratio_{name}"] = t_configured / t_bare
            out[f"channel_vs_configured_echo_ratio_{name}"] = (out[f"channel_vs_grpc_ratio_{name}"] * t_bare
                                                               / t_configured)
            if size >= 64 << 10:
                t_shared, t_echo = interleaved(lambda: shared.forward(state, train=False), lambda: echo(payload), n,
                                               warmup=3)
                out[f"channel_shared_vs_grpc_ratio_{name}"] = t_shared / t_echo
        # Once the shared client has a region with a direct-call link (its first 64 KiB tensor opens one), its
        # small calls take the link too (SharedLane.inline): 4 KiB over the link / the bare echo.
        shared.forward(CutState(torch.randn(64, 256)), train=False)
        if shared.shared.region is not None and shared.shared.region.direct is not None:
            small = CutState(torch.randn(4, 256))
            small_payload = small.hidden.numpy().tobytes()
            t_direct, t_echo = interleaved(lambda: shared.forward(small, train=False), lambda: echo(small_payload),
                                           repeat * 10, warmup=3)
            out["channel_direct_vs_grpc_ratio_4KiB"] = t_direct / t_echo
            out["channel_direct_rtt_4KiB_ms"] = t_direct * 1e3
        client.close()
        shared.close()
        configured.close()
        echo_channel.close()
        check_alive([proc], "the echo and trunk servers")
    finally:
        stop.set()
        end_children([proc])
    return out


# -- codec vs repeated float ------------------------------------------------------------
def _repeated_float_message() -> type:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    fdp = descriptor_pb2.FileDescriptorProto(name="bench_floats.proto", package="bench", syntax="proto3")
    msg = fdp.message_type.add(name="Floats")
    msg.field.add(name="values", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_FLOAT,
                  label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("bench.Floats"))


def codec_speedup(size_mib: int = 4, repeat: int = 5) -> dict[str, float]:
    """Round trip through protobuf ``repeated float`` / round trip through splitfed's codec."""
    from splitfed.channel.wire import fastwire
    from splitfed.channel.wire import split_channel_pb2 as pb
    from splitfed.codec.tensors import decode, encode

    floats = _repeated_float_message()
    t = torch.randn(size_mib * MiB // 4)
    header = pb.ForwardRequest(activation_id="bench")

    def codec() -> torch.Tensor:
        wire = fastwire.serialize(header, [encode("x", t)])
        return decode(fastwire.parse(pb.ForwardRequest, wire).tensors[0])

    def repeated() -> torch.Tensor:
        wire = floats(values=t.tolist()).SerializeToString()
        return torch.tensor(floats.FromString(wire).values, dtype=torch.float32)

    assert torch.equal(codec(), t) and torch.equal(repeated(), t)
    t_codec, t_rep = timeit(codec, repeat * 4), timeit(repeated, repeat, warmup=1)
    return {"codec_speedup_vs_repeated_float": t_rep / t_codec, f"codec_roundtrip_{size_mib}MiB_ms": t_codec * 1e3,
            f"repeated_float_roundtrip_{size_mib}MiB_ms": t_rep * 1e3}


# -- compression at the cut -------------------------------------------------------------------
def compression(repeat: int = 6, device: str = "cpu") -> dict[str, float]:
    """Bytes (and seconds) per split training step: uncompressed / int8 (and int8 + top-k gradients).

    One trunk server per setting in this process (each client alone in its step
    group), steps interleaved; bytes are the client's tensor payload both ways
    (data, scales, indices).
    """
    from bench.split_step import _trunk_server
    from splitfed.channel.client.remote import RemoteTrunk
    from splitfed.codec.compression import WireCompression
    from splitfed.split import SplitModel, split_model

    settings = dict(SPLIT_STEP)
    ids = torch.randint(0, settings["vocab"], (settings["batch"], settings["seq"]), device=device)
    wires = {"none": WireCompression.of("none"), "int8": WireCompression.of("int8"),
             "topk": WireCompression.of("int8", grad="topk", topk_ratio=0.01)}
    steps, remotes, servers = {}, {}, []
    try:
        for name, wire in wires.items():
            parts = split_model(_gpt2().to(device), _cuts())
            servers.append(_trunk_server(device, settings))
            remote = RemoteTrunk(servers[-1].address, insecure=True, wire_compression=wire)
            model = SplitModel(parts.bottom, remote, parts.top, task="causal-lm")
            opt = torch.optim.SGD(parts.client_modules().parameters(), lr=1e-3)

            def step(model: Any = model, opt: Any = opt) -> None:
                loss = model(ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
            steps[name], remotes[name] = step, remote
        t_int8, t_none = interleaved(steps["int8"], steps["none"], repeat)
        t_topk, _ = interleaved(steps["topk"], steps["none"], max(repeat // 2, 2))
        per_step = {name: (r.client.bytes_sent + r.client.bytes_received) / (r.client.calls / 2)
                    for name, r in remotes.items()}
        for remote in remotes.values():
            remote.close()
    finally:
        for server in servers:
            server.stop(grace=0)
    return {"compression_bytes_ratio_int8": per_step["none"] / per_step["int8"],
            "compression_bytes_ratio_topk": per_step["none"] / per_step["topk"],
            "compression_step_ratio_int8": t_int8 / t_none, "compression_step_ratio_topk": t_topk / t_none,
            "compression_bytes_per_step_none": per_step["none"], "compression_bytes_per_step_int8": per_step["int8"]}
