"""Batched decode steps captured as CUDA graphs compute what the same steps compute without graphs (GPU only)."""

from __future__ import annotations

import pytest
import torch
from conftest import spread_model

from splitfed.errors import ConfigError
from splitfed.split import CutState, split_model
from splitfed.trunk.compute.runtime import TrunkRuntime
from splitfed.trunk.inference.decoding import SessionStep
from splitfed.trunk.inference.sessions import SessionManager

CUTS = (1, 3)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_graphs_need_a_gpu() -> None:
    trunk = split_model(spread_model("gpt2"), CUTS).trunk
    with pytest.raises(ConfigError, match="GPU"):
        SessionManager(TrunkRuntime(trunk), decode_steps="graphs")
    with pytest.raises(ConfigError, match="decode_steps"):
        SessionManager(TrunkRuntime(trunk), decode_steps="fast")


class _Pair:
    """The same sessions on a manager with CUDA graphs and on one with the growing cache, one trunk on the GPU."""

    def __init__(self, trunk: torch.nn.Module, autocast: torch.dtype | None) -> None:
        def runtime() -> TrunkRuntime:
            return TrunkRuntime(trunk, device="cuda", autocast_dtype=autocast)

        self.graphs = SessionManager(runtime(), decode_steps="graphs")
        self.plain = SessionManager(runtime(), decode_steps="dynamic")
        self.width = trunk.config.hidden_size
        self.g = torch.Generator().manual_seed(0)
        self.ids: list[tuple[str, str]] = []

    def open(self, length: int) -> None:
        a, _ = self.graphs.open("c", max_length=128)
        b, _ = self.plain.open("c", max_length=128)
        hidden = torch.randn(1, length, self.width, generator=self.g)
        self.graphs.step("c", a, CutState(hidden))
        self.plain.step("c", b, CutState(hidden))
        self.ids.append((a, b))

    def decode(self, present: list[int], t: int) -> float:
        hidden = [torch.randn(1, 1, self.width, generator=self.g).cuda() for _ in present]
        got = self.graphs.run_many([SessionStep("c", self.ids[i][0], CutState(h), f"{t}") for i, h in
                                    zip(present, hidden)])
        want = self.plain.run_many([SessionStep("c", self.ids[i][1], CutState(h), f"{t}") for i, h in
                                    zip(present, hidden)])
        worst = 0.0
        for a, b in zip(got, want):
            assert not isinstance(a, BaseException) and not isinstance(b, BaseException), (a, b)
            worst = max(worst, float((a.float() - b.float()).abs().max()))
        return worst


@cuda
@pytest.mark.parametrize("arch,autocast,tol", [("gpt2", None, 1e-5), ("llama", None, 1e-5),
                                               ("gpt2", torch.bfloat16, 3e-2)])
def test_graph_steps_equal_plain_steps(monkeypatch: pytest.MonkeyPatch, arch: str, autocast: torch.dtype | None,
                                       tol: float) -> None:
    monkeypatch.setattr("splitfed.trunk.inference.fixedsteps.CAPACITY_STEP", 8)  # outgrown several times
    trunk = split_model(spread_model(arch), CUTS).trunk.cuda()
    pair = _Pair(trunk, autocast)
    for length in (3, 9, 5):
        pair.open(length)
    worst = 0.0
    # Execute: 20 steps; the last session sits two of them out
    for t in range(20):
        worst = max(worst, pair.decode([0, 1] if t in (5, 6) else [0, 1, 2], t))
    # Assert: equal steps; every step replayed a graph, captured again as the group outgrew its cache
    assert worst <= tol, worst
    stats = pair.graphs.stats
    assert stats["fixed_steps"] == 18 * 3 + 2 * 2 and stats["decode_batches"] == 20
    assert 3 <= stats["graph_captures"] <= 6, stats
    assert pair.plain.stats["fixed_steps"] == 0


@cuda
def test_graph_steps_read_the_weights_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    trunk = split_model(spread_model("gpt2"), CUTS).trunk.cuda()
    pair = _Pair(trunk, None)
    pair.open(4)
    pair.open(6)
    assert pair.decode([0, 1], 0) <= 1e-5
    captures = pair.graphs.stats["graph_captures"]
    # Execute: an in-place update (an optimizer step), then weights given new storage (as a replaced tensor)
    with torch.no_grad():
        for p in trunk.parameters():
            p.mul_(1.5)
    after_update = pair.decode([0, 1], 1)
    for p in trunk.parameters():
        p.data = p.data.clone()
    after_move = pair.decode([0, 1], 2)
    block = trunk.layers[0].mlp.c_fc
    block.weight = torch.nn.Parameter(block.weight.detach() * 2)  # a new parameter object
    after_swap = pair.decode([0, 1], 3)
    # Assert: each step read the current weights; the move and the swap captured again
    assert after_update <= 1e-5 and after_move <= 1e-5 and after_swap <= 1e-5
    assert pair.graphs.stats["graph_captures"] == captures + 2


def test_serve_takes_decode_steps_from_its_command_line() -> None:
    from splitfed.cli.main import _build_server, build_parser
    from splitfed.trunk.inference.fixedsteps import DECODE_STEPS

    # Prepare: the command line's choices are the library's
    parser = build_parser()
    action = next(a for sub in parser._subparsers._group_actions for name, p in sub.choices.items()  # type: ignore
                  if name == "serve" for a in p._actions if a.dest == "decode_steps")
    assert tuple(action.choices) == DECODE_STEPS
    # Execute: a server built from `splitfed serve --decode-steps fixed`
    args = parser.parse_args(["serve", "--model", "tiny-gpt2", "--insecure", "--decode-steps", "fixed"])
    args.authenticate, args.model = None, args.model[0]  # as `splitfed serve` sets them for one model
    server = _build_server(0, args)
    # Assert: its sessions take fixed steps
    sessions = server.unit().sessions
    assert sessions.decode_steps == "fixed" and sessions.fixed_steps


@cuda
def test_a_step_that_cannot_be_captured_runs_without_a_graph(monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    from splitfed.trunk.inference.fixedsteps import FixedSteps

    forward = FixedSteps._forward

    def syncing(self: FixedSteps) -> torch.Tensor:  # waits for the device: illegal while a graph is captured
        torch.cuda.current_stream().synchronize()
        return forward(self)

    monkeypatch.setattr(FixedSteps, "_forward", syncing)
    trunk = split_model(spread_model("gpt2"), CUTS).trunk.cuda()
    pair = _Pair(trunk, None)
    pair.open(4)
    pair.open(6)
    # Execute: steps whose capture fails
    worst = max(pair.decode([0, 1], t) for t in range(3))
    # Assert: exact all the same, one warning, and the manager's later groups take fixed steps without graphs
    assert worst <= 1e-5
    assert pair.graphs.stats["graph_captures"] == 0 and pair.graphs.stats["fixed_steps"] == 6
    assert pair.graphs.decode_steps == "fixed"
    assert sum("could not capture" in r.getMessage() for r in caplog.records) == 1
    torch.randn(4, device="cuda")  # the device's random generator works after the failed capture
    with torch.no_grad():
        torch.nn.functional.dropout(torch.ones(8, device="cuda"), 0.5, training=True)


@cuda
def test_graph_steps_of_a_lora_trunk_follow_its_adapters_as_they_train() -> None:
    pytest.importorskip("peft")
    from splitfed.models.lora import apply_lora, lora_config

    trunk = split_model(spread_model("llama"), CUTS).trunk
    apply_lora(trunk, lora_config("llama", rank=4), seed=0)
    trunk = trunk.cuda()
    with torch.no_grad():  # non-zero adapters: peft starts lora_B at zero
        for name, p in trunk.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    pair = _Pair(trunk, None)
    pair.open(5)
    pair.open(2)
    before = pair.decode([0, 1], 0)
    # Execute: an optimizer step on the adapters (in place), then more steps
    adapters = [p for p in trunk.parameters() if p.requires_grad]
    opt = torch.optim.SGD(adapters, lr=0.5)
    for p in adapters:
        p.grad = torch.ones_like(p)
    opt.step()
    after = max(pair.decode([0, 1], t) for t in range(1, 4))
    # Assert
    assert before <= 1e-5 and after <= 1e-5
    assert pair.graphs.stats["graph_captures"] == 1 and pair.graphs.stats["fixed_steps"] == 8


def test_a_graph_is_captured_again_when_a_weight_moves_or_is_replaced() -> None:
    from splitfed.trunk.inference.decodegroup import DecodeGroup
    from splitfed.trunk.inference.fixedsteps import FixedSteps

    # Prepare: fixed steps of a group of two on the CPU, their weights noted as at a capture
    trunk = split_model(spread_model("gpt2"), CUTS).trunk
    manager = SessionManager(TrunkRuntime(trunk))
    ids = [manager.open("c", max_length=32)[0] for _ in range(2)]
    for sid in ids:
        manager.step("c", sid, CutState(torch.randn(1, 3, trunk.config.hidden_size)))
    steps = FixedSteps(manager.runtime, DecodeGroup.stack(trunk, [manager._sessions[s] for s in ids]), False)
    steps._weights()
    unchanged = steps._moved()
    # Execute / Assert: new storage, then a new parameter object, each count as moved
    fc = trunk.layers[0].mlp.c_fc
    fc.weight.data = fc.weight.data.clone()
    moved = steps._moved()
    steps._weights()
    fc.weight = torch.nn.Parameter(fc.weight.detach().clone())
    assert (unchanged, moved, steps._moved()) == (False, True, True)
