"""Compression on a GPU: int8 and top-k parts are made and rebuilt on the device, alike to the host's, so that only
the compressed parts cross between host and GPU. Skipped without a GPU (run on a GPU machine:
``python -m pytest tests/test_gpu_compression.py``)."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, tiny_model
from test_gpu_server import LENGTHS, STREAMED, _exact_and_small, _run  # noqa: F401 - the fixture applies here too

from splitfed.channel.client.remote import RemoteTrunk
from splitfed.channel.wire.replies import decoded_on
from splitfed.channel.wire.messages import ReplyCompression
from splitfed.codec.tensors import TensorLimits, WireDType, decode, encode, encode_packed
from splitfed.codec.compression import CompressionSpec, dequantize_int8, quantize_int8
from splitfed.split import SplitModel, split_model
from splitfed.trunk.device.transfers import DeviceIO, PinnedPool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")
INT8 = CompressionSpec("int8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_parts_are_the_same_on_the_gpu_and_the_host(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        x = (torch.randn(3, 100_001, generator=g) * 5).to(dtype)  # not a whole number of blocks
        q, scales = quantize_int8(x)
        gq, gscales = quantize_int8(x.to(CUDA))
        assert torch.equal(q, gq.cpu()) and torch.equal(scales, gscales.cpu())
        back = dequantize_int8(q, scales, INT8.block_size, tuple(x.shape), dtype)
        assert torch.equal(back, dequantize_int8(gq, gscales, INT8.block_size, tuple(x.shape), dtype).cpu())


def test_an_int8_arrival_is_rebuilt_on_the_gpu_as_on_the_host() -> None:
    io = DeviceIO(CUDA, PinnedPool())
    for step in range(3):
        enc = encode("hidden", torch.randn(2, 7, 33), WireDType.BFLOAT16, INT8)
        want = decode(enc)
        assert enc.compressed is not None
        pinned = torch.frombuffer(bytearray(enc.data), dtype=torch.uint8).pin_memory()
        for data in (enc.data, pinned):  # staged into a pinned buffer first, or read where it is
            a = io.stage("hidden", data, torch.bfloat16, (2, 7, 33), scales=enc.compressed.scales,
                         block_size=enc.compressed.block_size)
            assert io.bring([a]) == [True]
            assert a.tensor.is_cuda and a.tensor.dtype == torch.bfloat16 and torch.equal(a.tensor.cpu(), want)
    assert io.stats["in-int8"] == 6


def test_a_reply_is_compressed_on_the_gpu_as_on_the_host_with_its_error_feedback() -> None:
    spec = CompressionSpec("int8", error_feedback=True)
    host, gpu = ReplyCompression(), ReplyCompression()
    for step in range(3):  # the residual of each step is added to the next
        x = torch.randn(4, 300)
        a = host.pack("c", f"r{step}", "grad", x, WireDType.BFLOAT16, spec)
        b = gpu.pack("c", f"r{step}", "grad", x.to(CUDA), WireDType.BFLOAT16, spec)
        assert b.payload.is_cuda and torch.equal(a.payload, b.payload.cpu()) and torch.equal(a.scales, b.scales.cpu())
    assert torch.equal(host.store.residual("c", "grad"), gpu.store.residual("c", "grad").cpu())
    again = gpu.pack("c", "r2", "grad", torch.randn(4, 300, device=CUDA), WireDType.BFLOAT16, spec)
    assert again is b  # a retried request gets the same parts; its feedback is not applied twice


def test_a_compressed_reply_is_rebuilt_on_the_callers_gpu() -> None:
    enc = encode_packed("grad", ReplyCompression().pack("c", "r", "grad", torch.randn(3, 40), WireDType.FLOAT32,
                                                        CompressionSpec("topk", topk_ratio=0.1)))
    out = decoded_on([enc], "grad", TensorLimits(), CUDA)
    assert out is not None and out.is_cuda and torch.equal(out.cpu(), decode(enc))
    assert decoded_on([enc], "grad", TensorLimits(), torch.device("cpu")) is None


@pytest.mark.parametrize("transport", ["off", "stream", "bulk"])
def test_int8_to_a_gpu_trunk_is_rebuilt_and_compressed_on_the_gpu(trunk_server, transport: str) -> None:
    ref_trunk, _, ref_outs, _ = _run(trunk_server, torch.device("cpu"), "off", window_ms=0, wire="int8")
    trunk, server, outs, errors = _run(trunk_server, CUDA, transport, window_ms=500, wire="int8")
    assert not errors and len(outs) == len(ref_outs) == 2 * len(LENGTHS)
    io = server.runtime.io
    assert io.stats["in-int8"] == 2 * len(outs)  # every activation and gradient crossed as int8, rebuilt there
    assert io.stats["out-packed"] == 2 * len(outs)  # every reply compressed on the GPU
    # Both trunks take the same int8 inputs; their outputs differ by rounding (GPU against CPU), which can move
    # an element of a reply by one int8 step of its block.
    for key, (out, grad_in, outcome) in ref_outs.items():
        got_out, got_grad, got_outcome = outs[key]
        assert outcome == got_outcome == "APPLIED"
        for ref, got in ((out, got_out), (grad_in, got_grad)):
            step = ref.abs().max() / 127
            assert (ref - got).abs().max() <= step * 1.01 + 1e-5, key
    for (name, a), b in zip(ref_trunk.state_dict().items(), trunk.state_dict().values()):
        assert torch.allclose(a, b.cpu(), atol=1e-3, rtol=1e-3), name


@pytest.mark.parametrize("bulk", [0, 2])
def test_a_gpu_client_compresses_and_rebuilds_on_its_gpu(trunk_server, bulk: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from splitfed.channel.client import trunk as client_module

    rebuilt = []
    real = client_module.decoded_on

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = real(*args, **kwargs)
        rebuilt.append(out is not None and out.is_cuda)
        return out
    monkeypatch.setattr(client_module, "decoded_on", spy)

    def train(device: torch.device, wire: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        parts = split_model(tiny_model("gpt2").train(), cuts=(1, 2))
        server = trunk_server(parts.trunk.to(device), lr=0.1, bulk_connections=bulk)
        remote = RemoteTrunk(server.address, insecure=True, shared_memory="off", wire_compression=wire,
                             bulk_connections=bulk, limits=STREAMED)
        model = SplitModel(parts.bottom.to(device), remote, parts.top.to(device), task="causal-lm")
        opt = torch.optim.SGD(parts.client_modules().parameters(), lr=0.1)
        ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
        for _ in range(2):
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        if bulk:
            assert remote.client.bulk.calls == 4 and remote.client.bulk.failed is None
        remote.close()
        return [p.detach().cpu() for p in [*parts.client_modules().parameters(), *parts.trunk.parameters()]]

    on_cpu = train(torch.device("cpu"), "int8")
    rebuilt.clear()
    on_gpu = train(CUDA, "int8")
    assert rebuilt and all(rebuilt)  # every reply rebuilt on the client's GPU
    for a, b in zip(on_cpu, on_gpu):
        assert torch.allclose(a, b, atol=1e-3, rtol=1e-3)
