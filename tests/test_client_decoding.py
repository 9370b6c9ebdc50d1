"""A generating client's bottom and top over fixed-size caches (CUDA graphs on a GPU): the same tokens and logits as
the growing caches, on every path ``generate`` takes."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import batch_for, spread_model

from splitfed.channel.client.trunk import TrunkClient
from splitfed.client import decoding
from splitfed.client.decoding import FixedDecoder, decoder_kind
from splitfed.client.generation import generate
from splitfed.errors import ConfigError
from splitfed.split import CutState, split_model

CUTS = (1, 3)
NEW = 12

pytestmark = pytest.mark.usefixtures("one_thread")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _reference(arch: str, ids: torch.Tensor, mask: torch.Tensor, **kwargs: object) -> torch.Tensor:
    model = spread_model(arch)
    kwargs.setdefault("pad_token_id", model.generation_config.pad_token_id or 0)
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, **kwargs)


@pytest.mark.parametrize("padded", [False, True], ids=["single", "left-padded-batch"])
@pytest.mark.parametrize("arch", ["gpt2", "llama", "gemma"])
def test_fixed_steps_match_unsplit_generate_over_the_channel(trunk_server, arch: str, padded: bool) -> None:
    # Prepare
    ids, mask, _ = batch_for(arch, batch=3 if padded else 1, length=7, padded=padded)
    want = _reference(arch, ids, mask)
    parts = split_model(spread_model(arch), CUTS)
    server = trunk_server(parts.trunk)
    # Execute
    with TrunkClient(server.address, insecure=True) as client:
        got = generate(parts.bottom, client, parts.top, ids, mask, max_new_tokens=NEW, decode_steps="fixed")
        sent = client.bytes_sent
    # Assert: the same tokens, and the same bytes on the wire as the growing caches send
    assert torch.equal(got, want), (got, want)
    with TrunkClient(server.address, insecure=True) as client:
        generate(parts.bottom, client, parts.top, ids, mask, max_new_tokens=NEW, decode_steps="dynamic")
        assert client.bytes_sent == sent


def test_fixed_logits_equal_the_growing_caches_step_by_step() -> None:
    # Prepare: a left-padded Llama batch, its prompt through the parts' growing caches
    ids, mask, _ = batch_for("llama", batch=3, length=7, padded=True)
    parts = split_model(spread_model("llama").eval(), CUTS)
    from splitfed.split.transformer import left_padded_positions

    positions = left_padded_positions(mask)
    caches = [p.new_cache() for p in (parts.bottom, parts.trunk, parts.top)]
    with torch.no_grad():
        def dynamic(step_ids: torch.Tensor, m: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            s = parts.bottom(step_ids, attention_mask=m, position_ids=pos, cache=caches[0], use_cache=True)
            h = parts.trunk(s, cache=caches[1], use_cache=True)
            return s.hidden, parts.top(h, cache=caches[2], use_cache=True)[:, -1, :]

        _, logits = dynamic(ids, mask, positions)
        decoder = FixedDecoder(parts.bottom, parts.top, caches[0], caches[2], mask, positions[:, -1:] + 1,
                               7 + NEW, graphs=False)
        fixed_caches = [caches[1]]  # the trunk keeps its growing cache in both runs
        import copy

        twin = copy.deepcopy(fixed_caches[0])
        tokens = logits.argmax(-1)[:, None]
        for _ in range(NEW - 1):
            # Execute: one step each way from the same tokens
            mask = torch.cat([mask, mask.new_ones(3, 1)], dim=1)
            positions = positions[:, -1:] + 1
            want_hidden, want = dynamic(tokens, mask, positions)
            hidden = decoder.bottom_step(tokens)
            trunk_out = parts.trunk(CutState(hidden, mask, positions), cache=twin, use_cache=True).hidden
            got = decoder.top_step(trunk_out)
            # Assert
            assert torch.allclose(hidden, want_hidden, atol=1e-5, rtol=1e-5)
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
            tokens = want.argmax(-1)[:, None]
    assert decoder.length == 7 + NEW - 1


def test_stop_tokens_and_local_trunk_with_fixed_steps() -> None:
    ids, mask, _ = batch_for("gpt2", batch=3, length=7, padded=True)
    free = _reference("gpt2", ids, mask, eos_token_id=None)
    stop = int(free[0, 7 + 3])
    want = _reference("gpt2", ids, mask, eos_token_id=stop, pad_token_id=0)
    parts = split_model(spread_model("gpt2"), CUTS)
    got = generate(parts.bottom, parts.trunk, parts.top, ids, mask, max_new_tokens=NEW, eos_token_id=stop,
                   pad_token_id=0, decode_steps="fixed")
    assert torch.equal(got, want)


def test_a_decoder_that_is_full_refuses_another_step() -> None:
    ids, mask, _ = batch_for("gpt2", batch=1, length=4)
    parts = split_model(spread_model("gpt2").eval(), CUTS)
    caches = [parts.bottom.new_cache(), parts.top.new_cache()]
    with torch.no_grad():
        state = parts.bottom(ids, cache=caches[0], use_cache=True)
        parts.top(parts.trunk(state), cache=caches[1], use_cache=True)
    decoder = FixedDecoder(parts.bottom, parts.top, caches[0], caches[1], mask, torch.full((1, 1), 4), 5,
                           graphs=False)
    decoder.top_step(parts.trunk(CutState(decoder.bottom_step(ids[:, :1]))).hidden)
    with pytest.raises(ValueError, match="hold 5 positions"):
        decoder.bottom_step(ids[:, :1])
    with pytest.raises(ValueError, match="no room"):
        FixedDecoder(parts.bottom, parts.top, caches[0], caches[1], mask, torch.full((1, 1), 4), 4, graphs=False)


def test_decode_steps_choices() -> None:
    gpt2 = split_model(spread_model("gpt2"), CUTS)
    qwen2 = split_model(spread_model("qwen2"), CUTS)  # its top holds a sliding-window block
    assert decoder_kind(gpt2.bottom, gpt2.top, "auto", 64) is None  # on the CPU: the growing caches
    assert decoder_kind(gpt2.bottom, gpt2.top, "fixed", 64) == "fixed"
    assert decoder_kind(gpt2.bottom, gpt2.top, "fixed", 1) is None  # one token: no decode step
    assert decoder_kind(qwen2.bottom, qwen2.top, "auto", 64) is None
    assert decoder_kind(gpt2.bottom, gpt2.top, "dynamic", 64) is None
    with pytest.raises(ConfigError, match="needs the parts on a CUDA device"):
        decoder_kind(gpt2.bottom, gpt2.top, "graphs", 64)
    with pytest.raises(ConfigError, match="full past through SDPA"):
        decoder_kind(qwen2.bottom, qwen2.top, "fixed", 64)
    with pytest.raises(ConfigError, match="decode_steps must be one of"):
        decoder_kind(gpt2.bottom, gpt2.top, "static", 64)
    ids, mask, _ = batch_for("qwen2", batch=1, length=5)
    with pytest.raises(ConfigError, match="full past"):
        generate(qwen2.bottom, qwen2.trunk, qwen2.top, ids, mask, max_new_tokens=4, decode_steps="fixed")


def _lora_parts(arch: str, device: str = "cpu"):  # type: ignore[no-untyped-def]
    """Split parts with LoRA adapters on the bottom and the top, their B matrices non-zero (so they count)."""
    from splitfed.models.lora import apply_lora, lora_config

    parts = split_model(spread_model(arch).to(device).eval(), CUTS)
    for part in (parts.bottom, parts.top):
        apply_lora(part, lora_config(arch, rank=4), seed=0)
        with torch.no_grad():
            for name, param in part.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
    return parts


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_fixed_steps_run_lora_adapters_as_the_growing_caches_do(arch: str) -> None:
    pytest.importorskip("peft")
    ids, mask, _ = batch_for(arch, batch=2, length=7, padded=True)
    parts = _lora_parts(arch)
    plain = split_model(spread_model(arch).eval(), CUTS)
    dynamic = generate(parts.bottom, parts.trunk, parts.top, ids, mask, max_new_tokens=NEW, decode_steps="dynamic")
    fixed = generate(parts.bottom, parts.trunk, parts.top, ids, mask, max_new_tokens=NEW, decode_steps="fixed")
    without = generate(plain.bottom, plain.trunk, plain.top, ids, mask, max_new_tokens=NEW, decode_steps="fixed")
    assert torch.equal(fixed, dynamic)
    assert not torch.equal(fixed, without)  # the adapters changed what the parts compute


# -- on a GPU: the steps as CUDA graphs ----------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_by_default_a_gpu_generation_replays_graphs_that_match_the_growing_caches(arch: str) -> None:
    ids, mask, _ = batch_for(arch, batch=3, length=7, padded=True)
    parts = split_model(spread_model(arch).cuda().eval(), CUTS)
    ids, mask = ids.cuda(), mask.cuda()
    made: list[FixedDecoder] = []

    class Spy(FixedDecoder):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            made.append(self)

    original = decoding.FixedDecoder
    import splitfed.client.generation as generation

    generation.FixedDecoder = Spy  # type: ignore[misc]
    try:
        graphs = generate(parts.bottom, parts.trunk, parts.top, ids, mask, max_new_tokens=NEW)  # the default: auto
    finally:
        generation.FixedDecoder = original  # type: ignore[misc]
    dynamic = generate(parts.bottom, parts.trunk, parts.top, ids, mask, max_new_tokens=NEW, decode_steps="dynamic")
    assert torch.equal(graphs, dynamic)
    assert len(made) == 1 and made[0].graphs and made[0].captures == 2


@gpu
def test_graph_steps_replay_lora_adapters_as_the_growing_caches_do() -> None:
    pytest.importorskip("peft")
    ids, mask, _ = batch_for("llama", batch=2, length=7, padded=True)
    parts = _lora_parts("llama", "cuda")
    ids, mask = ids.cuda(), mask.cuda()
    graphs = generate(parts.bottom, parts.trunk, parts.top, ids, mask, max_new_tokens=NEW, decode_steps="graphs")
    dynamic = generate(parts.bottom, parts.trunk, parts.top, ids, mask, max_new_tokens=NEW, decode_steps="dynamic")
    assert torch.equal(graphs, dynamic)


@gpu
def test_a_capture_that_fails_falls_back_once_and_leaves_the_generator_usable(monkeypatch, caplog) -> None:
    ids, mask, _ = batch_for("gpt2", batch=1, length=7)
    parts = split_model(spread_model("gpt2").cuda().eval(), CUTS)
    ids, mask = ids.cuda(), mask.cuda()
    want = generate(parts.bottom, parts.trunk, parts.top, ids, mask, max_new_tokens=NEW, decode_steps="dynamic")
    real = FixedDecoder._bottom

    def syncing(self: FixedDecoder) -> torch.Tensor:
        out = real(self)
        if torch.cuda.is_current_stream_capturing():
            out.sum().item()  # a read back to the host: not capturable
        return out

    monkeypatch.setattr(FixedDecoder, "_bottom", syncing)
    with caplog.at_level(logging.WARNING, logger="splitfed.client.decoding"):
        got = generate(parts.bottom, parts.trunk, parts.top, ids, mask, max_new_tokens=NEW, decode_steps="graphs")
    assert torch.equal(got, want)
    assert sum("could not capture" in r.message for r in caplog.records) == 1
    torch.rand(4, device="cuda")  # the device's generator still draws
