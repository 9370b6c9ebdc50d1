"""Copies at the cut are counted: on the CPU a pipelined step copies each tensor that crosses the cut only where it
must (into the gRPC message, and into memory of its own where it lands), on both sides of the channel."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import batch_for, tiny_model

from splitfed.codec import transfer
from splitfed.channel.client import trunk as client_module
from splitfed.channel.wire import fastwire
from splitfed.channel.wire import messages as wire
from splitfed.channel.client.remote import RemoteTrunk
from splitfed.codec.tensors import EncodedTensor
from splitfed.split import SplitModel, split_model
from splitfed.codec.transfer import Staging


def _address(data: object) -> int:
    view = memoryview(data).cast("B")  # type: ignore[arg-type]
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


class _Counter:
    """Wraps the channel's encode, decode and serialize; counts the copies each makes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.encode_copies = self.encodes = self.decode_copies = self.decodes = 0
        self.serialized_payload = self.messages = 0
        encode, decode, serialize = wire.encode, wire.decode, fastwire.serialize

        def counting_encode(name: str, tensor: torch.Tensor, *args: object, **kwargs: object) -> EncodedTensor:
            enc = encode(name, tensor, *args, **kwargs)
            self.encodes += 1
            self.encode_copies += int(_address(enc.data) != tensor.data_ptr())
            return enc

        def counting_decode(enc: EncodedTensor, *args: object) -> torch.Tensor:
            out = decode(enc, *args)
            self.decodes += 1
            start = _address(enc.data)
            self.decode_copies += int(not start <= out.data_ptr() < start + len(enc.data))
            return out

        def counting_serialize(header: object, tensors: list[EncodedTensor]) -> bytes:
            self.messages += 1
            self.serialized_payload += sum(len(memoryview(t.data).cast("B")) for t in tensors)
            return serialize(header, tensors)

        monkeypatch.setattr(wire, "encode", counting_encode)
        monkeypatch.setattr(client_module, "encode", counting_encode)
        monkeypatch.setattr(wire, "decode", counting_decode)
        monkeypatch.setattr(fastwire, "serialize", counting_serialize)


def test_a_pipelined_cpu_step_copies_only_where_it_must(trunk_server, monkeypatch: pytest.MonkeyPatch) -> None:
    parts = 4
    split = split_model(tiny_model("gpt2").train(), (1, 3))
    server = trunk_server(split.trunk, optimizer="sgd", lr=0.01)
    remote = RemoteTrunk(server.address, insecure=True)
    model = SplitModel(split.bottom, remote, split.top, task="causal-lm", micro_batches=parts)
    ids, mask, labels = batch_for("gpt2", batch=parts, padded=True)
    model(ids, attention_mask=mask, labels=labels).loss.backward()  # warm up (connections, lazy imports)
    counter = _Counter(monkeypatch)
    for key in transfer.COPIES:
        transfer.COPIES[key] = 0
    sent0, received0 = remote.client.bytes_sent, remote.client.bytes_received
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    # Per micro-batch: Forward (hidden, mask; default positions stay home) and its reply, Backward and its reply.
    assert counter.encodes == parts * (2 + 1 + 1 + 1)
    assert counter.encode_copies == 0  # every tensor is encoded from its own memory, on both sides
    assert counter.decodes == parts * (2 + 1 + 1 + 1)
    assert counter.decode_copies == 0  # decoded tensors view the received bytes, on both sides
    # gRPC's Python API takes bytes: each payload is copied once into its message, never twice.
    assert counter.messages == 4 * parts
    assert counter.serialized_payload == (remote.client.bytes_sent - sent0 + remote.client.bytes_received
                                          - received0)
    # Where it lands, each activation and each input gradient gets memory of its own (the received bytes are
    # read-only): one copy each, and nothing else crosses a device or changes dtype.
    assert transfer.COPIES == {"d2h": 0, "h2d": 0, "cast": 0, "own": 2 * parts}
    remote.close()


def test_bf16_wire_casts_once_before_the_copy(trunk_server, monkeypatch: pytest.MonkeyPatch) -> None:
    parts = 2
    split = split_model(tiny_model("llama").train(), (1, 3))
    server = trunk_server(split.trunk, optimizer="sgd", lr=0.01)
    remote = RemoteTrunk(server.address, insecure=True, wire_dtype="bf16")
    model = SplitModel(split.bottom, remote, split.top, task="causal-lm", micro_batches=parts)
    ids, mask, labels = batch_for("llama", batch=parts, padded=True)
    counter = _Counter(monkeypatch)
    for key in transfer.COPIES:
        transfer.COPIES[key] = 0
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    # The client casts each activation and gradient to bf16 once (then encodes it in place), and back to fp32
    # once where it lands; the server's replies are cast by its encoder.
    assert transfer.COPIES == {"d2h": 0, "h2d": 0, "cast": 4 * parts, "own": 0}
    assert counter.encode_copies == 2 * parts  # the server's two replies per micro-batch, fp32 -> bf16
    remote.close()


def test_cpu_staging_is_free() -> None:
    staging = Staging("cpu")
    t = torch.randn(3, 4)
    copy = staging.to_host(t)
    assert copy.wait() is not None and copy.wait().data_ptr() == t.data_ptr()
    copy.release()
    assert staging.pooled == 0


@pytest.mark.parametrize("streamed", [False, True])
def test_an_owned_reply_is_copied_only_where_it_views_the_received_bytes(trunk_server, streamed: bool,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A unary reply views gRPC's read-only bytes: an owned output is a copy. A streamed reply is gathered into a
    buffer of the client's own: the owned output is that buffer, not a second copy of it (forward and backward)."""
    from splitfed.channel.wire.limits import ChannelLimits
    from splitfed.split import CutState

    split = split_model(tiny_model("gpt2").train(), (1, 3))
    limits = ChannelLimits(stream_threshold_bytes=1024, chunk_bytes=512) if streamed else ChannelLimits()
    server = trunk_server(split.trunk, optimizer="sgd", lr=1e-9, limits=limits)
    decoded: list[tuple[int, int, torch.Tensor]] = []
    decode_single = client_module.decode_single

    def recording(encs: list[EncodedTensor], *args: object) -> torch.Tensor:
        out = decode_single(encs, *args)  # type: ignore[arg-type]
        decoded.append((_address(encs[0].data), len(encs[0].data), out))
        return out

    monkeypatch.setattr(client_module, "decode_single", recording)
    client = client_module.TrunkClient(server.address, insecure=True, limits=limits, shared_memory="off")
    hidden = torch.randn(2, 8, 32)
    out, _ = client.forward(CutState(hidden), activation_id="a", owned=True)
    reply = client.backward("a", torch.ones_like(out), input_numel=hidden.numel(), owned=True)
    with torch.no_grad():
        expected = split.trunk(CutState(hidden.clone())).hidden
    assert torch.allclose(out, expected, atol=1e-6) and reply.grad.shape == hidden.shape
    assert [t is r for (_, _, t), r in zip(decoded, (out, reply.grad))] == [streamed, streamed]
    for (start, size, _), result in zip(decoded, (out, reply.grad)):
        assert (start <= result.data_ptr() < start + size) == streamed  # viewed where gathered, else copied
    client.close()
