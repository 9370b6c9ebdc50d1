"""Batched prefills: several sessions' first steps as one trunk call give what each session gets alone."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from splitfed.errors import TrunkBusyError
from splitfed.split import CutState, split_model
from splitfed.trunk.compute.runtime import TrunkRuntime
from splitfed.trunk.inference.decoding import SessionStep
from splitfed.trunk.inference.sessions import SessionManager

CUTS = (1, 3)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models run fastest on one thread


class _Twin:
    """The same sessions on two managers: ``batched`` prefills them together, ``alone`` one by one."""

    def __init__(self, arch: str) -> None:
        trunk = split_model(tiny_model(arch), CUTS).trunk
        self.batched, self.alone = SessionManager(TrunkRuntime(trunk)), SessionManager(TrunkRuntime(trunk))
        self.width = trunk.config.hidden_size
        self.g = torch.Generator().manual_seed(0)
        self.peer: dict[str, str] = {}
        self.past: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {}

    def prompt(self, length: int, batch: int = 1, explicit: bool = True) -> tuple[str, CutState]:
        """A new session on both and its prompt (row 1 of a batch left-padded by 2; ``explicit``: with mask and
        positions, else neither)."""
        a, _ = self.batched.open("c", max_length=64, batch_size=batch)
        b, _ = self.alone.open("c", max_length=64, batch_size=batch)
        self.peer[a] = b
        hidden = torch.randn(batch, length, self.width, generator=self.g)
        if not explicit:
            self.past[a] = None
            return a, CutState(hidden)
        mask = torch.ones(batch, length, dtype=torch.long)
        if batch > 1:
            mask[1, :2] = 0
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        self.past[a] = (mask, pos[:, -1:])
        return a, CutState(hidden, mask, pos)

    def prefill(self, prompts: list[tuple[str, CutState]], tag: str = "p") -> float:
        """The prompts as one window on ``batched``, one by one on ``alone``; the largest difference."""
        got = self.batched.run_many([SessionStep("c", s, st, f"{tag}-{s}") for s, st in prompts])
        worst = 0.0
        for (s, st), out in zip(prompts, got):
            assert not isinstance(out, BaseException), out
            ref = self.alone.step("c", self.peer[s], st)
            assert out.shape == ref.shape
            worst = max(worst, float((out - ref).abs().max()))
        return worst

    def decode(self, sessions: list[str], t: int) -> float:
        """One decode step of every session: batched on one manager, alone on the other; the largest difference."""
        steps, want = [], []
        for s in sessions:
            batch = self.batched._sessions[s].batch_size
            past = self.past[s]
            if past is None:
                state = CutState(torch.randn(batch, 1, self.width, generator=self.g))
            else:
                mask, pos = past
                mask, pos = torch.cat([mask, mask.new_ones(batch, 1)], 1), pos + 1
                self.past[s] = (mask, pos)
                state = CutState(torch.randn(batch, 1, self.width, generator=self.g), mask, pos)
            steps.append(SessionStep("c", s, state, f"{t}-{s}"))
            want.append(self.alone.step("c", self.peer[s], state))
        worst = 0.0
        for out, ref in zip(self.batched.run_many(steps), want):
            assert not isinstance(out, BaseException), out
            worst = max(worst, float((out - ref).abs().max()))
        return worst


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_batched_prefills_equal_prefills_alone_and_leave_the_same_caches(arch: str) -> None:
    # Prepare: prompts of 3, 7 (a left-padded batch of 2), 12 and 5 positions (the last without mask or positions)
    twin = _Twin(arch)
    prompts = [twin.prompt(3), twin.prompt(7, batch=2), twin.prompt(12), twin.prompt(5, explicit=False)]
    # Execute: one window of prefills, then batched decode steps on the caches the prefill left
    worst = twin.prefill(prompts)
    held_after_prefill = (twin.batched.bytes_held, twin.alone.bytes_held)
    live = [s for s, _ in prompts]
    worst_decode = max(twin.decode(live, t) for t in range(6))
    # Assert: the prefill ran as one call, and every output (prefill and decode) is what each session gets alone
    stats = twin.batched.stats
    assert stats["prefill_batches"] == 1 and stats["batched_prefills"] == 4, stats
    assert worst <= 1e-5, worst
    assert worst_decode <= 1e-5, worst_decode
    for s, st in prompts:
        session = twin.batched._sessions[s]
        assert session.length == st.hidden.shape[1] + 6
    # each session kept only its own rows and real positions (the decode group pads; the prefill does not)
    assert held_after_prefill[0] == held_after_prefill[1], held_after_prefill


def test_equal_prompts_without_masks_batch_without_padding() -> None:
    # Prepare: three prompts of 6 positions, neither mask nor positions (what unpadded generation sends)
    twin = _Twin("llama")
    prompts = [twin.prompt(6, explicit=False) for _ in range(3)]
    # Execute
    worst = twin.prefill(prompts)
    worst_decode = max(twin.decode([s for s, _ in prompts], t) for t in range(3))
    # Assert
    assert twin.batched.stats["batched_prefills"] == 3
    assert worst <= 1e-5 and worst_decode <= 1e-5, (worst, worst_decode)


def test_sliding_window_sessions_batch_only_prompts_the_window_keeps() -> None:
    # Prepare: qwen2's tiny config keeps 3 positions in its sliding-window layers
    twin = _Twin("qwen2")
    short = [twin.prompt(2), twin.prompt(3, explicit=False)]
    long = [twin.prompt(3), twin.prompt(9)]
    # Execute
    worst = max(twin.prefill(short, "short"), twin.prefill(long, "long"))
    worst_decode = max(twin.decode([s for s, _ in short + long], t) for t in range(6))
    # Assert: the short prompts batched; the window holding a longer prompt ran its prefills alone; all exact
    stats = twin.batched.stats
    assert stats["prefill_batches"] == 1 and stats["batched_prefills"] == 2, stats
    assert worst <= 1e-5 and worst_decode <= 1e-5, (worst, worst_decode)


def test_repeated_prefill_window_answers_again_and_keeps_the_caches() -> None:
    # Prepare
    twin = _Twin("llama")
    prompts = [twin.prompt(4), twin.prompt(6)]
    steps = [SessionStep("c", s, st, f"again-{s}") for s, st in prompts]
    first = twin.batched.run_many(steps)
    # Execute: the same step ids again (the replies were lost)
    again = twin.batched.run_many(steps)
    # Assert: the same answers, the caches as the first prefill left them
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert [twin.batched._sessions[s].length for s, _ in prompts] == [4, 6]
    assert twin.batched.stats["retried_steps"] == 2 and twin.batched.stats["prefill_batches"] == 1


def test_a_failed_batched_prefill_leaves_the_sessions_empty_and_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: the trunk runs out of device memory once
    twin = _Twin("llama")
    prompts = [twin.prompt(4), twin.prompt(6)]
    trunk = twin.batched.runtime.trunk
    real = type(trunk).forward
    calls = {"n": 0}

    def once_out_of_memory(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise torch.OutOfMemoryError("out of memory (test)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(trunk), "forward", once_out_of_memory)
    # Execute: the window fails, then the clients send the same prompts again
    failed = twin.batched.run_many([SessionStep("c", s, st, f"p-{s}") for s, st in prompts])
    lengths_after_failure = [twin.batched._sessions[s].length for s, _ in prompts]
    monkeypatch.setattr(type(trunk), "forward", real)
    worst = twin.prefill(prompts, "retry")
    # Assert: each step was told to retry (busy), nothing was kept, and the retry is exact
    assert all(isinstance(out, TrunkBusyError) for out in failed), failed
    assert lengths_after_failure == [0, 0]
    assert worst <= 1e-5
