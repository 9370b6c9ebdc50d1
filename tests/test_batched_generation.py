"""Batched decoding: concurrent sessions' decode steps as one trunk call give what each session gets alone."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import batch_for, spread_model, tiny_model

from splitfed.channel.client.trunk import TrunkClient
from splitfed.client.generation import generate
from splitfed.split import CutState, split_model
from splitfed.trunk.inference.decoding import SessionStep
from splitfed.trunk.compute.runtime import TrunkRuntime
from splitfed.trunk.inference.sessions import SessionManager

CUTS = (1, 3)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models run fastest on one thread


_model = spread_model


class _Twin:
    """The same sessions on two managers: ``batched`` steps them together, ``alone`` one by one."""

    def __init__(self, trunk: torch.nn.Module, decode_steps: str = "auto") -> None:
        self.batched = SessionManager(TrunkRuntime(trunk), decode_steps=decode_steps)
        self.alone = SessionManager(TrunkRuntime(trunk))
        self.width = trunk.config.hidden_size
        self.g = torch.Generator().manual_seed(0)
        self.peer: dict[str, str] = {}
        self.past: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # session -> (mask, last position)

    def open(self, length: int, batch: int = 1) -> str:
        """Open a session on both and prefill it with ``length`` positions (row 1 left-padded by 2)."""
        a, _ = self.batched.open("c", max_length=64, batch_size=batch)
        b, _ = self.alone.open("c", max_length=64, batch_size=batch)
        hidden = torch.randn(batch, length, self.width, generator=self.g)
        mask = torch.ones(batch, length, dtype=torch.long)
        if batch > 1:
            mask[1, :2] = 0
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        torch.testing.assert_close(self.batched.step("c", a, CutState(hidden, mask, pos)),
                                   self.alone.step("c", b, CutState(hidden, mask, pos)), rtol=0, atol=0)
        self.peer[a], self.past[a] = b, (mask, pos[:, -1:])
        return a

    def close(self, session: str) -> None:
        self.batched.close("c", session)
        self.alone.close("c", self.peer.pop(session))

    def decode(self, sessions: list[str], t: int) -> float:
        """One decode step of ``sessions``: batched on one manager, alone on the other; the largest difference."""
        steps, want = [], []
        for s in sessions:
            mask, pos = self.past[s]
            batch = mask.shape[0]
            mask, pos = torch.cat([mask, mask.new_ones(batch, 1)], 1), pos + 1
            self.past[s] = (mask, pos)
            padded = bool((mask == 0).any())
            state = CutState(torch.randn(batch, 1, self.width, generator=self.g),
                             mask if padded or t % 3 else None, pos if padded or t % 4 else None)
            steps.append(SessionStep("c", s, state, f"{t}-{s}"))
            want.append(self.alone.step("c", self.peer[s], state))
        got = self.batched.run_many(steps)
        worst = 0.0
        for out, ref in zip(got, want):
            assert not isinstance(out, BaseException), out
            assert out.shape == ref.shape
            worst = max(worst, float((out - ref).abs().max()))
        return worst


@pytest.fixture(params=["dynamic", "fixed"])
def decode_steps(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Groups step over a growing cache, or over a fixed-size one (what a GPU's CUDA graphs replay) that the steps
    outgrow several times."""
    monkeypatch.setattr("splitfed.trunk.inference.fixedsteps.CAPACITY_STEP", 8)
    return request.param


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2"])  # qwen2: sliding-window layers of 4 positions
def test_batched_decode_steps_equal_single_steps(arch: str, decode_steps: str) -> None:
    # Prepare: four sessions of different lengths, one a left-padded batch of two
    twin = _Twin(split_model(tiny_model(arch), CUTS).trunk, decode_steps)
    live = [twin.open(3), twin.open(7, batch=2), twin.open(12), twin.open(5)]
    worst = 0.0
    # Execute: 16 steps; one closes, two join, one sits some steps out
    for t in range(16):
        if t == 4:
            twin.close(live.pop(1))
        if t == 7:
            live.append(twin.open(9))
        if t == 10:
            live.append(twin.open(2, batch=2))
        worst = max(worst, twin.decode(live if t % 5 else live[:-1], t))
    # Assert: every step equals its unbatched twin, and the steps did batch (and regroup as the set changed)
    assert worst <= 1e-6, worst
    stats = twin.batched.stats
    assert stats["decode_batches"] == 16 and stats["batched_steps"] == stats["steps"] - 6  # 6 prefills
    assert stats["decode_groups"] >= 5
    fixed = decode_steps == "fixed" and arch != "qwen2"  # sliding-window layers keep the growing cache
    assert stats["fixed_steps"] == (stats["batched_steps"] if fixed else 0)
    assert twin.batched.bytes_held > 0


def test_repeated_step_in_a_batch_answers_again_and_keeps_the_cache() -> None:
    # Prepare
    twin = _Twin(split_model(tiny_model("llama"), CUTS).trunk)
    live = [twin.open(4), twin.open(6)]
    twin.decode(live, 1)
    steps = [SessionStep("c", s, CutState(torch.randn(1, 1, twin.width), None, None), f"again-{s}") for s in live]
    first = twin.batched.run_many(steps)
    lengths = [twin.batched._sessions[s].length for s in live]
    # Execute: the same step ids again (replies lost), batched
    again = twin.batched.run_many(steps)
    # Assert
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert [twin.batched._sessions[s].length for s in live] == lengths
    assert twin.batched.stats["retried_steps"] == 2


def test_closing_or_evicting_a_grouped_session_gives_the_others_their_caches(decode_steps: str) -> None:
    # Prepare: three sessions decoding as one group
    twin = _Twin(split_model(tiny_model("gpt2"), CUTS).trunk, decode_steps)
    live = [twin.open(3), twin.open(8), twin.open(5)]
    twin.decode(live, 1)
    group = twin.batched._sessions[live[0]].group
    assert group is not None and set(group.session_ids) == set(live)
    # Execute: one closes; the other two go on, then one steps alone
    twin.close(live.pop(1))
    assert all(twin.batched._sessions[s].group is None for s in live)
    worst = twin.decode(live, 2)
    worst = max(worst, twin.decode(live[:1], 3))
    worst = max(worst, twin.decode(live, 4))
    # Assert
    assert worst <= 1e-6


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_lone_session_takes_fixed_steps_as_a_group_of_one(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("splitfed.trunk.inference.fixedsteps.CAPACITY_STEP", 8)
    # Prepare: one session, then a second one that joins it
    twin = _Twin(split_model(tiny_model(arch), CUTS).trunk, "fixed")
    first = twin.open(5)
    # Execute: ten steps alone, then four together
    worst = max(twin.decode([first], t) for t in range(10))
    second = twin.open(3)
    worst = max([worst] + [twin.decode([first, second], t) for t in range(10, 14)])
    # Assert: exact; the lone steps ran over a fixed-size cache yet count as no batch
    assert worst <= 1e-6, worst
    stats = twin.batched.stats
    assert stats["fixed_steps"] == 18 and stats["decode_batches"] == 4 and stats["batched_steps"] == 8
    assert stats["decode_groups"] == 1


def _reference(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, new: int) -> torch.Tensor:
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                          pad_token_id=model.generation_config.pad_token_id or 0,
                          eos_token_id=model.generation_config.eos_token_id)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_concurrent_sessions_over_the_channel_equal_unbatched_generate(trunk_server, arch: str) -> None:
    # Prepare: four clients with prompts of 3, 6 (a left-padded batch of 2), 9 and 12 tokens and different budgets;
    # the fourth joins when the first has 3 tokens, so sessions join and leave while others decode
    model = _model(arch)
    prompts = []
    for i, (length, batch, new) in enumerate([(3, 1, 14), (6, 2, 8), (9, 1, 11), (12, 1, 10)]):
        ids, mask, _ = batch_for(arch, batch=batch, length=length, padded=batch > 1, seed=10 + i)
        prompts.append((ids, mask, new))
    want = [_reference(model, ids, mask, new) for ids, mask, new in prompts]
    parts = split_model(_model(arch), CUTS)
    server = trunk_server(parts.trunk, batch_window_ms=50)
    started, got, errors = threading.Event(), [None] * 4, []
    tokens = {"eos_token_id": model.generation_config.eos_token_id,
              "pad_token_id": model.generation_config.pad_token_id or 0}

    def client(i: int) -> None:
        ids, mask, new = prompts[i]
        seen = []

        def stream(t: torch.Tensor) -> None:
            seen.append(t)
            if i == 0 and len(seen) == 3:
                started.set()

        if i == 3:
            started.wait(60)
        with TrunkClient(server.address, insecure=True) as channel:
            try:
                got[i] = generate(parts.bottom, channel, parts.top, ids, mask, max_new_tokens=new, streamer=stream,
                                  **tokens)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                started.set()

    # Execute
    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    # Assert: token for token the unsplit model's greedy output, and the decode steps did batch
    assert not errors, errors
    for i, (g, w) in enumerate(zip(got, want)):
        assert g is not None and torch.equal(g, w), (i, g, w)
    stats = server.servicer.sessions.stats
    assert stats["batched_steps"] >= 8 and stats["decode_batches"] >= 2, stats
    assert len(server.servicer.sessions) == 0  # every session closed


def test_window_zero_steps_sessions_alone(trunk_server) -> None:
    # Prepare
    parts = split_model(_model("llama"), CUTS)
    server = trunk_server(parts.trunk)  # batch_window_ms = 0: batching off
    ids, mask, _ = batch_for("llama", batch=1, length=5)
    # Execute
    with TrunkClient(server.address, insecure=True) as channel:
        generate(parts.bottom, channel, parts.top, ids, mask, max_new_tokens=4)
    # Assert
    stats = server.servicer.sessions.stats
    assert stats["steps"] == 4 and stats["batched_steps"] == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2's sliding layers restack instead of skipping
def test_late_members_sit_steps_out_and_rejoin_exactly(arch: str, decode_steps: str) -> None:
    from splitfed.trunk.inference.decoding import MAX_MISSED

    # Prepare: four sessions decoding as one group
    twin = _Twin(split_model(tiny_model(arch), CUTS).trunk, decode_steps)
    live = [twin.open(3), twin.open(6, batch=2), twin.open(10), twin.open(4)]
    worst = twin.decode(live, 0)
    groups = twin.batched.stats["decode_groups"]
    # Execute: the last session is late for 2 steps, then back; then the first misses more steps than allowed
    worst = max(worst, twin.decode(live[:3], 1), twin.decode(live[:3], 2), twin.decode(live, 3))
    regrouped_after_late = twin.batched.stats["decode_groups"] - groups
    for t in range(MAX_MISSED + 1):
        worst = max(worst, twin.decode(live[1:], 4 + t))
    worst = max(worst, twin.decode(live, 10), twin.decode(live[2:3], 11), twin.decode(live, 12))
    # Assert: exact throughout; full-attention groups kept the late member without restacking
    assert worst <= 1e-6, worst
    if arch == "llama":
        assert regrouped_after_late == 0
        assert twin.batched._sessions[live[0]].group is not None  # back in a group after restacking
    else:
        assert regrouped_after_late == 2


@pytest.mark.parametrize("explicit", [True, False])
def test_a_group_step_keeps_the_hidden_state_on_the_device_it_arrived_on(explicit: bool) -> None:
    # A trunk on a GPU receives a step's hidden state there (a shared-memory region with CUDA events) and its mask
    # and positions on the host; "meta" stands in for the GPU: a tensor of another device in one torch.cat fails.
    twin = _Twin(split_model(tiny_model("llama"), CUTS).trunk)
    live = [twin.open(3), twin.open(6, batch=2), twin.open(4)]
    twin.decode(live, 0)
    group = twin.batched._sessions[live[0]].group
    assert group is not None and group.session_ids == tuple(live)
    states: list[CutState | None] = []
    for s in live[:2]:  # the last member sits this step out
        mask, pos = twin.past[s]
        b = mask.shape[0]
        hidden = torch.zeros(b, 1, twin.width, device="meta")
        states.append(CutState(hidden, torch.cat([mask, mask.new_ones(b, 1)], 1), pos + 1) if explicit
                      else CutState(hidden))
    # Execute
    batch = group.inputs([*states, None] if explicit else [*states, CutState(torch.zeros(1, 1, twin.width,
                                                                                        device="meta"))])
    # Assert: the hidden state stays where it came (the runtime places mask and positions with it)
    assert batch.hidden.device.type == "meta" and batch.hidden.shape[0] == 4
    assert batch.attention_mask is not None and batch.attention_mask.shape == (4, group.length + 1)


def test_batched_prefill_inputs_keep_the_hidden_state_on_the_device_it_arrived_on() -> None:
    from splitfed.trunk.inference.prefill import _inputs

    # Prepare: prompts of different lengths, their hidden states on another device than their masks
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0
    states = [CutState(torch.zeros(2, 5, 8, device="meta"), mask, (mask.cumsum(-1) - 1).clamp(min=0)),
              CutState(torch.zeros(1, 3, 8, device="meta"))]
    # Execute
    batch, rows, lengths = _inputs(states)
    # Assert
    assert batch.hidden.device.type == "meta" and batch.hidden.shape == (3, 5, 8)
    assert rows == [slice(0, 2), slice(2, 3)] and lengths == [5, 3]
    assert batch.attention_mask is not None and batch.attention_mask[2].tolist() == [True] * 3 + [False] * 2
