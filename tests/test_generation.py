"""Split generation with a server-side KV cache: equality with unsplit ``generate``, sessions, limits, the CLI."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import VOCAB, batch_for, spread_model

from splitfed.channel.client.trunk import TrunkClient
from splitfed.errors import (
    ChannelError,
    ConfigError,
    PermissionDeniedError,
    SessionNotFoundError,
)
from splitfed.client.generation import LocalSession, RemoteSession, generate, pick_tokens
from splitfed.split import CutState, split_model
from splitfed.trunk.compute.runtime import TrunkRuntime
from splitfed.trunk.inference.sessions import SessionLimits, SessionManager, cache_bytes

CUTS = (1, 3)
NEW = 12


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models run fastest on one thread


class FakeClock:
    """A clock tests move by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


_model = spread_model


def _reference(arch: str, ids: torch.Tensor, mask: torch.Tensor, **kwargs: object) -> torch.Tensor:
    model = _model(arch)
    kwargs.setdefault("pad_token_id", model.generation_config.pad_token_id or 0)
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, **kwargs)


def _tokens(arch: str) -> dict[str, object]:
    cfg = _model(arch).generation_config
    return {"eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id or 0}


def _client(server, **kwargs: object) -> TrunkClient:
    return TrunkClient(server.address, insecure=True, **kwargs)


# -- equality with the unsplit model ------------------------------------------------------------------
@pytest.mark.parametrize("padded", [False, True], ids=["single", "left-padded-batch"])
@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2", "gemma"])
def test_greedy_matches_unsplit_generate(trunk_server, arch: str, padded: bool) -> None:
    # Prepare
    ids, mask, _ = batch_for(arch, batch=3 if padded else 1, length=7, padded=padded)
    want = _reference(arch, ids, mask)
    parts = split_model(_model(arch), CUTS)
    server = trunk_server(parts.trunk)
    client = _client(server)
    # Execute: the trunk's cache on the server, one position per step on the wire
    got = generate(parts.bottom, client, parts.top, ids, mask, max_new_tokens=NEW, **_tokens(arch))
    # Assert
    assert torch.equal(got, want), (got, want)
    assert len(set(got[0, 7:].tolist())) > 1  # a real sequence, not one repeated token
    assert server.servicer.sessions.describe()["steps"] == NEW and len(server.servicer.sessions) == 0


def test_greedy_over_a_regions_direct_link_matches_unsplit_generate(trunk_server, monkeypatch) -> None:
    # The prompt (7 positions) goes through a shared-memory region, which opens with its direct-call link; each
    # one-position step after it is too small for the region and goes inline over that link, not gRPC.
    from splitfed.channel.transports.shm import lane

    arch = "llama"
    ids, mask, _ = batch_for(arch, batch=1, length=7, padded=False)
    want = _reference(arch, ids, mask)
    parts = split_model(_model(arch), CUTS)
    monkeypatch.setattr(lane, "MIN_REGION_TENSOR_BYTES", 4 * 4 * parts.trunk.config.hidden_size)
    server = trunk_server(parts.trunk)
    with _client(server) as client:
        got = generate(parts.bottom, client, parts.top, ids, mask, max_new_tokens=NEW, **_tokens(arch))
        assert client.shared.calls == 1 and client.shared.inline_calls == NEW - 1
    assert torch.equal(got, want), (got, want)
    assert server.direct.listener.stats["calls"] == NEW


def test_local_mode_matches_unsplit() -> None:
    ids, mask, _ = batch_for("llama", batch=3, length=7, padded=True)
    want = _reference("llama", ids, mask)
    parts = split_model(_model("llama"), CUTS)
    assert torch.equal(generate(parts.bottom, parts.trunk, parts.top, ids, mask, max_new_tokens=NEW,
                                **_tokens("llama")), want)
    runtime = TrunkRuntime(parts.trunk)  # local mode also takes a runtime (steps under its lock)
    with LocalSession(runtime, max_length=7 + NEW) as session:
        assert torch.equal(generate(parts.bottom, session, parts.top, ids, mask, max_new_tokens=NEW,
                                    **_tokens("llama")), want)


def test_each_step_sends_only_the_new_position(trunk_server) -> None:
    ids, mask, _ = batch_for("gpt2", batch=1, length=7)
    parts = split_model(_model("gpt2"), CUTS)
    client = _client(trunk_server(parts.trunk))
    generate(parts.bottom, client, parts.top, ids, mask, max_new_tokens=NEW)
    hidden = 4 * 32  # one fp32 position of hidden size 32
    # Without padding the trunk takes positions from its cache: no mask or position ids travel.
    assert client.bytes_sent == 7 * hidden + (NEW - 1) * hidden
    assert client.bytes_received == (7 + NEW - 1) * hidden


def test_a_padded_batch_sends_its_mask_and_positions_each_step(trunk_server) -> None:
    ids, mask, _ = batch_for("gpt2", batch=2, length=7, padded=True)
    assert not bool(mask.all())
    parts = split_model(_model("gpt2"), CUTS)
    client = _client(trunk_server(parts.trunk))
    got = generate(parts.bottom, client, parts.top, ids, mask, max_new_tokens=NEW)
    assert torch.equal(got, _reference("gpt2", ids, mask))
    hidden = 4 * 32
    prefill = 2 * (7 * hidden + 7 + 8 * 7)  # per row: hidden, bool mask, int64 positions
    steps = sum(2 * (hidden + (7 + i) + 8) for i in range(1, NEW))
    assert client.bytes_sent == prefill + steps
    assert client.bytes_received == 2 * (7 + NEW - 1) * hidden


# -- stopping, sampling, streaming ------------------------------------------------------------------------
def test_stop_tokens_match_unsplit_eos_and_end_early() -> None:
    ids, mask, _ = batch_for("llama", batch=3, length=7, padded=True)
    free = _reference("llama", ids, mask, eos_token_id=None)
    stop = int(free[0, 7 + 3])  # row 0 emits this token at its 4th step
    want = _reference("llama", ids, mask, eos_token_id=stop, pad_token_id=0)
    parts = split_model(_model("llama"), CUTS)
    by_eos = generate(parts.bottom, parts.trunk, parts.top, ids, mask, max_new_tokens=NEW, eos_token_id=stop,
                      pad_token_id=0)
    by_stop = generate(parts.bottom, parts.trunk, parts.top, ids, mask, max_new_tokens=NEW,
                       stop_token_ids=[stop], pad_token_id=0)
    assert torch.equal(by_eos, want) and torch.equal(by_stop, want)
    assert int(by_eos[0, 7 + 3]) == stop and (by_eos[0, 7 + 4:] == 0).all()
    # A single sequence that stops ends the generation.
    single = generate(parts.bottom, parts.trunk, parts.top, ids[:1], mask[:1], max_new_tokens=NEW,
                      stop_token_ids=[stop])
    assert single.shape[1] == 7 + 4 and int(single[0, -1]) == stop


def test_sampling_is_reproducible_with_a_seed() -> None:
    ids, mask, _ = batch_for("gpt2", batch=2, length=5)
    parts = split_model(_model("gpt2"), CUTS)

    def run(**kwargs: object) -> torch.Tensor:
        return generate(parts.bottom, parts.trunk, parts.top, ids, mask, max_new_tokens=NEW, **kwargs)

    a = run(temperature=1.5, top_k=20, top_p=0.9, seed=7)
    assert torch.equal(a, run(temperature=1.5, top_k=20, top_p=0.9, seed=7))
    assert not torch.equal(a, run(temperature=1.5, top_k=20, top_p=0.9, seed=8))
    assert ((a >= 0) & (a < VOCAB)).all()
    greedy = run()
    assert torch.equal(run(temperature=1.0, top_k=1, seed=1), greedy)  # top-k 1 is greedy
    assert torch.equal(run(temperature=1.0, top_p=1e-6, seed=1), greedy)  # so is a tiny nucleus


def test_pick_tokens_filters() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    g = torch.Generator().manual_seed(0)
    picks = {int(pick_tokens(logits, temperature=1.0, top_k=2, generator=g)) for _ in range(200)}
    assert picks == {2, 3}
    picks = {int(pick_tokens(logits, temperature=1.0, top_p=0.7, generator=g)) for _ in range(200)}
    assert picks == {2, 3}  # p(3) = 0.64 < 0.7, so the nucleus needs token 2 as well
    assert int(pick_tokens(logits)) == 3


def test_streamer_sees_every_new_token_in_order(trunk_server) -> None:
    ids, mask, _ = batch_for("qwen2", batch=2, length=6, padded=True)
    parts = split_model(_model("qwen2"), CUTS)
    client = _client(trunk_server(parts.trunk))
    seen: list[torch.Tensor] = []
    out = generate(parts.bottom, client, parts.top, ids, mask, max_new_tokens=NEW, streamer=seen.append)
    assert len(seen) == NEW and torch.equal(torch.stack(seen, dim=1), out[:, 6:])


# -- losing the session -----------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["closed", "evicted", "server-restart"])
def test_lost_session_is_replayed_and_output_unchanged(trunk_server, how: str) -> None:
    # Prepare: a server whose session manager runs on a clock the test moves
    ids, mask, _ = batch_for("gemma", batch=3, length=7, padded=True)
    want = _reference("gemma", ids, mask)
    parts = split_model(_model("gemma"), CUTS)
    clock = FakeClock()
    runtime = TrunkRuntime(parts.trunk)
    server = trunk_server(runtime, sessions=SessionManager(runtime, idle_ttl_s=60, clock=clock))
    client = _client(server)
    count = [0]

    def lose(tokens: torch.Tensor) -> None:
        count[0] += 1
        if count[0] not in (3, 8):
            return
        manager = server.servicer.sessions
        if how == "closed":
            manager.close(client.client_id, session.session_id)
        elif how == "evicted":
            clock.now += 61
            assert manager.sweep() == 1
        else:  # a restarted server knows no session
            server.servicer.sessions = SessionManager(runtime, clock=clock)

    # Execute
    with RemoteSession(client, max_length=7 + NEW, batch_size=3) as session:
        got = generate(parts.bottom, session, parts.top, ids, mask, max_new_tokens=NEW, streamer=lose,
                       **_tokens("gemma"))
    # Assert
    assert session.reopened == 2
    assert torch.equal(got, want)


def test_session_gives_up_after_repeated_losses(trunk_server) -> None:
    parts = split_model(_model("gpt2"), CUTS)
    server = trunk_server(parts.trunk)
    client = _client(server)

    class Forgetful:  # loses every session before its first step
        def open(self, client_id: str, **kwargs: object) -> tuple[str, float]:
            return "gone", 1.0

        def step(self, *args: object, **kwargs: object) -> torch.Tensor:
            raise SessionNotFoundError("inference session 'gone' is unknown")

        def close(self, *args: object) -> None:
            raise SessionNotFoundError("inference session 'gone' is unknown")

        def sweep(self) -> int:
            return 0

    server.servicer.sessions = Forgetful()
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ChannelError) as info, RemoteSession(client, max_length=8, max_reopens=2) as session:
        generate(parts.bottom, session, parts.top, ids, max_new_tokens=3)
    assert info.value.code == "NOT_FOUND" and session.reopened == 2


# -- session limits and errors ------------------------------------------------------------------------------
def test_session_cap_is_resource_exhausted(trunk_server) -> None:
    parts = split_model(_model("llama"), CUTS)
    server = trunk_server(parts.trunk, session_limits=SessionLimits(max_sessions=2))
    client = _client(server)
    client.open_session(16)
    client.open_session(16)
    with pytest.raises(ChannelError) as info:
        client.open_session(16)
    assert info.value.code == "RESOURCE_EXHAUSTED" and "close sessions" in str(info.value)


def test_cache_byte_cap_is_resource_exhausted(trunk_server) -> None:
    parts = split_model(_model("llama"), CUTS)
    per_position = 2 * 2 * 2 * 8 * 4  # K and V, 2 trunk layers, 2 KV heads, head dim 8, fp32
    server = trunk_server(parts.trunk, session_limits=SessionLimits(max_cache_bytes=100 * per_position))
    client = _client(server)
    client.open_session(60)
    with pytest.raises(ChannelError) as info:
        client.open_session(20, batch_size=3)
    assert info.value.code == "RESOURCE_EXHAUSTED" and "smaller max_length" in str(info.value)
    client.open_session(40)  # what is left still fits


def test_unknown_foreign_and_too_long_sessions(trunk_server) -> None:
    parts = split_model(_model("llama"), CUTS)
    server = trunk_server(parts.trunk)
    alice, mallory = _client(server, client_id="alice"), _client(server, client_id="mallory")
    state = CutState(torch.randn(1, 3, 32), torch.ones(1, 3, dtype=torch.long), torch.arange(3)[None])
    with pytest.raises(ChannelError) as info:
        alice.forward(state, train=False, session_id="nope")
    assert info.value.code == "NOT_FOUND" and "open a new session" in str(info.value)
    with pytest.raises(ChannelError) as info:
        alice.close_session("nope")
    assert info.value.code == "NOT_FOUND"
    sid, ttl = alice.open_session(4)
    assert ttl == SessionLimits().idle_ttl_s
    for call in (lambda: mallory.forward(state, train=False, session_id=sid), lambda: mallory.close_session(sid)):
        with pytest.raises(ChannelError) as info:
            call()
        assert info.value.code == "PERMISSION_DENIED"
    alice.forward(state, train=False, session_id=sid)
    more = CutState(torch.randn(1, 2, 32), torch.ones(1, 5, dtype=torch.long), torch.arange(3, 5)[None])
    with pytest.raises(ChannelError) as info:
        alice.forward(more, train=False, session_id=sid)
    assert info.value.code == "INVALID_ARGUMENT" and "larger max_length" in str(info.value)
    alice.close_session(sid)
    with pytest.raises(ChannelError) as info:
        alice.forward(state, train=False, session_id=sid)
    assert info.value.code == "NOT_FOUND" and "was closed" in str(info.value)


def test_idle_sessions_are_evicted_and_free_their_bytes() -> None:
    parts = split_model(_model("llama"), CUTS)
    clock = FakeClock()
    manager = SessionManager(TrunkRuntime(parts.trunk), idle_ttl_s=30, clock=clock)
    busy, _ = manager.open("alice", max_length=16, batch_size=2)
    idle, _ = manager.open("bob", max_length=16, batch_size=2)
    for sid, who in ((busy, "alice"), (idle, "bob")):
        manager.step(who, sid, CutState(torch.randn(2, 5, 32), torch.ones(2, 5, dtype=torch.long)))
    per_position = 2 * 2 * 2 * 8 * 4
    assert manager.bytes_held == 2 * 2 * 5 * per_position
    assert manager.bytes_reserved == 2 * 2 * 16 * per_position
    clock.now += 20
    manager.step("alice", busy, CutState(torch.randn(2, 1, 32), torch.ones(2, 6, dtype=torch.long)))
    clock.now += 15  # bob idle for 35 s, alice for 15 s
    assert manager.sweep() == 1
    assert manager.bytes_held == 2 * 6 * per_position
    assert manager.describe()["evicted_idle"] == 1 and len(manager) == 1
    with pytest.raises(SessionNotFoundError, match="evicted after 30 s"):
        manager.step("bob", idle, CutState(torch.randn(2, 1, 32)))


def test_repeated_step_is_answered_again_and_ownership_is_checked() -> None:
    parts = split_model(_model("gpt2"), CUTS)
    manager = SessionManager(TrunkRuntime(parts.trunk))
    sid, _ = manager.open("alice", max_length=8)
    state = CutState(torch.randn(1, 3, 32), torch.ones(1, 3, dtype=torch.long), torch.arange(3)[None])
    first = manager.step("alice", sid, state, step_id="s1")
    again = manager.step("alice", sid, state, step_id="s1")  # a retry whose reply was lost
    assert torch.equal(first, again) and manager.stats["retried_steps"] == 1
    assert cache_bytes(manager._sessions[sid].cache) == 3 * 2 * 2 * 32 * 4  # K, V x 2 layers x 3 positions
    with pytest.raises(PermissionDeniedError):
        manager.step("mallory", sid, state)


def test_steps_wait_for_the_runtime_lock() -> None:
    parts = split_model(_model("gpt2"), CUTS)
    runtime = TrunkRuntime(parts.trunk)
    manager = SessionManager(runtime)
    sid, _ = manager.open("alice", max_length=8)
    done = threading.Event()
    with runtime._lock:  # an optimizer step in progress
        worker = threading.Thread(target=lambda: (manager.step("alice", sid, CutState(torch.randn(1, 2, 32))),
                                                  done.set()))
        worker.start()
        assert not done.wait(0.2)
    worker.join(10)
    assert done.is_set()


def test_server_serves_sessions_for_decoders_only(trunk_server) -> None:
    assert isinstance(trunk_server(split_model(_model("gpt2"), CUTS).trunk).servicer.sessions, SessionManager)
    assert trunk_server(split_model(_model("bert"), CUTS).trunk).servicer.sessions is None


def test_bad_arguments_say_what_to_do() -> None:
    parts = split_model(_model("gpt2"), CUTS)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ConfigError, match="max_length >= 8"):
        generate(parts.bottom, LocalSession(parts.trunk, 6), parts.top, ids, max_new_tokens=5)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        generate(parts.bottom, parts.trunk, parts.top, ids, max_new_tokens=0)
    with pytest.raises(ConfigError, match="new_cache"):
        LocalSession(torch.nn.Linear(2, 2), 4)


# -- the console command -------------------------------------------------------------------------------------
@pytest.fixture
def saved_gpt2(tmp_path):
    """A tiny GPT-2 and a word-level tokenizer saved to a folder (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="[UNK]")
    _model("gpt2").save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return tmp_path, tokenizer


def _expected_text(path, tokenizer, prompt: str, n: int) -> str:
    from splitfed.models.llm import load_model as load_pretrained

    model = load_pretrained(str(path)).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         pad_token_id=0)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True) + "\n"


def test_cli_generate_with_a_local_trunk(saved_gpt2, capsys) -> None:
    from splitfed.cli.main import main

    path, tokenizer = saved_gpt2
    assert main(["generate", "--model", str(path), "--cuts", "1,3", "--prompt", "w1 w2 w3",
                 "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert out == _expected_text(path, tokenizer, "w1 w2 w3", 8) and len(out.split()) >= 2


def test_cli_generate_with_a_remote_trunk(saved_gpt2, trunk_server, capsys) -> None:
    from splitfed.cli.main import main
    from splitfed.models.llm import load_model as load_pretrained

    path, tokenizer = saved_gpt2
    server = trunk_server(split_model(load_pretrained(str(path)).eval(), CUTS).trunk, cuts=CUTS)
    args = ["generate", "--model", str(path), "--prompt", "w4 w5", "--max-new-tokens", "6", "--trunk",
            server.address, "--insecure"]
    assert main(args + ["--cuts", "1,3"]) == 0
    assert capsys.readouterr().out == _expected_text(path, tokenizer, "w4 w5", 6)
    assert main(args + ["--cuts", "2,3"]) == 1  # one line that says which cuts to pass
    assert "splitfed generate: error: " in (err := capsys.readouterr().err) and "pass --cuts 1,3" in err
    assert len(server.servicer.sessions) == 0


def test_generation_bench_reports_its_keys(monkeypatch) -> None:
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent))  # bench/ is not installed
    from bench.generation import generation

    out = generation(new_tokens=4, prompt_len=4, repeat=1)
    assert {"gen_bytes_per_token_cache", "gen_bytes_per_token_nocache", "gen_latency_ratio"} <= set(out)
    assert out["gen_greedy_match"] == 1.0
    assert out["gen_bytes_per_token_nocache"] > out["gen_bytes_per_token_cache"] > 0
