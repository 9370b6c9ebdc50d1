"""The split step against the unsplit step (``split_step_ratio*``): a GPT-2 training step split over the real
channel on loopback, divided by the same step unsplit, timed interleaved in one run.

Transports (``--transports``): ``auto`` (through a shared-memory region, client and trunk on one host),
``socket`` (every byte over loopback TCP: what another host would pay before the network itself), ``bulk`` (the
socket with a bulk link of :data:`BULK_CONNECTIONS` TCP connections carrying the streamed calls' bytes), and over
TLS, as a deployment between hosts runs: ``tls`` (gRPC streams over TLS) and ``bulk-tls`` (a TLS channel with a
TLS bulk link). TLS runs use a certificate issued for 127.0.0.1 at the start, pinned by the client.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import torch

from bench.core import SPLIT_STEP, _cuts, _gpt2, interleaved
from bench.host_syncs import count_host_syncs
from bench.processes import check_alive, end_children, get_from

#: Connections of a bulk link (the split step's ``bulk`` and ``bulk-tls`` transports).
BULK_CONNECTIONS = 4
TRANSPORTS = ("auto", "socket", "bulk", "tls", "bulk-tls")


def _trunk_server(device: str, settings: dict[str, int], tls: tuple[bytes, bytes] | None = None) -> Any:
    """A trunk server of the split step's model (``tls``: serve TLS with this certificate and key, PEM)."""
    from splitfed.channel.server.trunkserver import TrunkServer
    from splitfed.split import split_model
    from splitfed.trunk.compute.runtime import TrunkRuntime

    SPLIT_STEP.update(settings)
    trunk = split_model(_gpt2().to(device), _cuts()).trunk
    runtime = TrunkRuntime(trunk, torch.optim.SGD(trunk.parameters(), lr=1e-3),
                           autocast_dtype=torch.bfloat16 if settings["bf16"] else None)
    if tls is None:
        return TrunkServer(runtime, insecure=True, bulk_connections=BULK_CONNECTIONS).start()
    from splitfed.channel.security.bulktls import server_context
    from splitfed.channel.security.credentials import server_credentials_from_pem

    cert, key = tls
    return TrunkServer(runtime, credentials=server_credentials_from_pem(cert, key),
                       bulk_connections=BULK_CONNECTIONS, bulk_tls=server_context(cert, key)).start()


def _serve_trunk(settings: dict[str, int], port_queue: Any, stop: Any, threads: int, device: str,
                 tls: tuple[bytes, bytes] | None = None) -> None:
    torch.set_num_threads(threads)
    server = _trunk_server(device, settings, tls)
    port_queue.put(server.port)
    stop.wait()
    server.stop(grace=0)


def _wire(name: str) -> Any:
    """The :class:`~splitfed.codec.compression.WireCompression` a bench's ``--wire-compression`` names."""
    from splitfed.codec.compression import WireCompression

    return WireCompression.of("int8", grad="topk", topk_ratio=0.01) if name == "topk" else WireCompression.of(name)


def _client_tls(transport: str, ca_pem: bytes | None) -> dict[str, Any]:
    """A split-step client's transport security: plaintext, or TLS pinned to the run's CA (with a TLS link)."""
    if not transport.endswith("tls"):
        return {"insecure": True}
    from splitfed.channel.security.bulktls import BulkTLS
    from splitfed.channel.security.credentials import pinned_channel_credentials

    assert ca_pem is not None
    return {"credentials": pinned_channel_credentials(ca_pem),
            "bulk_tls": BulkTLS.client(ca_pem) if transport == "bulk-tls" else None}


def split_step_ratio(repeat: int = 10, device: str = "cpu", micro_batches: tuple[int, ...] = (1,),
                     wire_compression: str = "none", transports: tuple[str, ...] = ("auto", "socket")
                     ) -> dict[str, float]:
    """Split step over loopback / unsplit step; the trunk server in this process and in another.

    ``split_step_ratio`` serves the trunk from a thread of this process (the
    real gRPC channel over loopback TCP, no second Python process competing for
    the cores); ``split_step_ratio_process`` serves it from its own process, as
    in a deployment, but on the same cores as the client. For each k > 1 in
    ``micro_batches`` the split step also runs pipelined as k micro-batches
    (over min(k, 4) gRPC channels): ``split_step_ratio_mb{k}`` and
    ``split_step_ratio_process_mb{k}``, each timed interleaved with the unsplit step. ``wire_compression``
    (none, int8, topk) is what crosses the cut in every split run (reported as ``split_step_wire_compression``).
    ``transports`` (see the module docstring): keys carry ``_socket``, ``_bulk``, ``_tls`` or ``_bulk_tls``
    (none for ``auto``). On a GPU, ``split_step_host_syncs*`` (trunk in this process: the client's and the
    trunk's) and ``unsplit_step_host_syncs`` count the host's reads of the device in one step
    (:mod:`bench.host_syncs`).
    """
    from splitfed.channel.client.remote import RemoteTrunk
    from splitfed.split import SplitModel, split_model

    cuts, settings = _cuts(), dict(SPLIT_STEP)
    batch, seq, bf16 = settings["batch"], settings["seq"], bool(settings["bf16"])
    ctx = mp.get_context("spawn")
    tls = ca_pem = None
    if any(t.endswith("tls") for t in transports):
        from splitfed.channel.security.autotls import issue

        issued = issue(["127.0.0.1"])
        tls, ca_pem = (issued.cert_pem, issued.server_key_pem), issued.ca_pem
    stop = ctx.Event()
    servers: dict[tuple[str, bool], str] = {}
    procs, in_process, queues = [], [], {}
    for secure in sorted({t.endswith("tls") for t in transports}):
        queues[secure] = ctx.Queue()
        procs.append(ctx.Process(target=_serve_trunk, args=(settings, queues[secure], stop, torch.get_num_threads(),
                                                            device, tls if secure else None), daemon=True))
        procs[-1].start()
        in_process.append(_trunk_server(device, settings, tls if secure else None))
        servers[("", secure)] = in_process[-1].address
    out: dict[str, float] = {}
    try:
        for secure, port_queue in queues.items():
            port = get_from(port_queue, procs, 120, "the trunk server process port")
            servers[("_process", secure)] = f"127.0.0.1:{port}"
        ref = _gpt2().to(device)
        opt_ref = torch.optim.SGD(ref.parameters(), lr=1e-3)
        ids = torch.randint(0, settings["vocab"], (batch, seq), device=device)

        def autocast() -> Any:
            return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16)

        def sync() -> None:
            if device.startswith("cuda"):
                torch.cuda.synchronize()

        def ref_step() -> None:
            with autocast():
                loss = ref(input_ids=ids, labels=ids).loss
            loss.backward()
            opt_ref.step()
            opt_ref.zero_grad()
            sync()

        runs = [(f"{where}{'' if transport == 'auto' else '_' + transport.replace('-', '_')}"
                 f"{'' if k == 1 else f'_mb{k}'}", servers[(where, transport.endswith('tls'))], k, transport)
                for where in ("", "_process") for transport in transports for k in micro_batches]
        for suffix, address, k, transport in runs:
            parts = split_model(_gpt2().to(device), cuts)
            bulk = transport.startswith("bulk")
            remote = RemoteTrunk(address, wire_dtype="bf16" if bf16 else "fp32",
                                 channels=min(k, 4), max_in_flight=2 * k,
                                 wire_compression=_wire(wire_compression),
                                 shared_memory="auto" if transport == "auto" else "off",
                                 bulk_connections=BULK_CONNECTIONS if bulk else 0, **_client_tls(transport, ca_pem))
            model = SplitModel(parts.bottom, remote, parts.top, task="causal-lm", micro_batches=k)
            opt_split = torch.optim.SGD(parts.client_modules().parameters(), lr=1e-3)

            def split_step() -> None:
                with autocast():
                    loss = model(ids, labels=ids).loss
                loss.backward()
                opt_split.step()
                opt_split.zero_grad()
                sync()

            t_split, t_ref = interleaved(split_step, ref_step, repeat)
            if device.startswith("cuda") and not suffix.startswith("_process"):  # client and trunk both seen here
                out[f"split_step_host_syncs{suffix}"] = count_host_syncs(split_step)
                if "unsplit_step_host_syncs" not in out:  # the unsplit step is the same in every run
                    out["unsplit_step_host_syncs"] = count_host_syncs(ref_step)
            out[f"split_step_ratio{suffix}"] = t_split / t_ref
            out[f"split_step{suffix}_s"] = t_split
            out[f"unsplit_step{suffix}_s"] = t_ref
            if k == 1 and transport == "socket":
                out["split_bytes_per_call"] = remote.client.bytes_sent / max(remote.client.calls, 1)
            if bulk:
                if remote.client.bulk.failed is not None:
                    raise RuntimeError(f"split_step{suffix}: the bulk link was given up: {remote.client.bulk.failed}")
                out[f"split_step_bulk_fraction{suffix}"] = remote.client.bulk.calls / max(remote.client.calls, 1)
            if transport == "auto":
                out[f"split_step_shared_fraction{suffix}"] = remote.client.shared.bytes / max(
                    remote.client.bytes_sent + remote.client.bytes_received, 1)
                # Calls whose copies went device to device through the region's GPU memory.
                out[f"split_step_gpu_copy_fraction{suffix}"] = remote.client.shared.on_gpu / max(
                    remote.client.shared.calls, 1)
            remote.client.leave()  # the next client must not wait for this one in the trunk's sync step
            remote.close()
        check_alive(procs, "the trunk server")
        return out
    finally:
        for server in in_process:
            server.stop(grace=0)
        stop.set()
        end_children(procs)
