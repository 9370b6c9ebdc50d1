"""Privacy: DP-SGD against a manual per-example computation, accounting across rounds, noise at the cut,
and Flower's central-DP wrappers around the SplitFed strategy."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from conftest import batch_for, tiny_cnn, tiny_model
from torch import nn

from splitfed.errors import ConfigError, PrivacyBudgetError, UnsupportedModelError
from splitfed.privacy import (
    Accountant,
    ClientPrivacy,
    CutNoise,
    PrivacyConfig,
    PrivateTraining,
    clip_and_noise,
    noise_for_epsilon,
)
from splitfed.split import SplitModel, split_model
from splitfed.split.base import CutState

warnings.filterwarnings("ignore", message="Full backward hook is firing")

LORA_TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"], "llama": ["q_proj", "v_proj", "down_proj"]}


# -- helpers --------------------------------------------------------------------------------------------
def _split(kind: str, trunk: nn.Module | None = None) -> tuple[SplitModel, object]:
    """A local three-part model of ``kind``: cnn, gpt2, llama, gemma, or lora-gpt2 / lora-llama."""
    if kind == "cnn":
        parts = split_model(tiny_cnn(), (3, 6))
    else:
        arch = kind.removeprefix("lora-")
        parts = split_model(tiny_model(arch, layers=4), (1, 3))
    bottom, top = parts.bottom, parts.top
    if kind.startswith("lora-"):
        from peft import LoraConfig, get_peft_model

        arch = kind.removeprefix("lora-")
        extra = {"fan_in_fan_out": True} if arch == "gpt2" else {}
        # Random B (not the zero init) so both adapter matrices get non-zero gradients.
        bottom = get_peft_model(bottom, LoraConfig(r=4, target_modules=LORA_TARGETS[arch], init_lora_weights=False,
                                                   **extra))
        top = get_peft_model(top, LoraConfig(r=4, target_modules=LORA_TARGETS[arch], init_lora_weights=False,
                                             **extra))
    model = SplitModel(bottom, trunk if trunk is not None else parts.trunk, top, task=parts.task)
    return model.train(), parts


def _batch(kind: str, n: int = 4) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    if kind == "cnn":
        g = torch.Generator().manual_seed(3)
        return torch.randn(n, 1, 28, 28, generator=g), None, torch.randint(0, 10, (n,), generator=g)
    return batch_for(kind.removeprefix("lora-"), batch=n, length=10)


def _trainable(model: SplitModel) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.client_modules().named_parameters() if p.requires_grad]


def _manual_clipped_sum(model: SplitModel, batch: tuple, clip: float) -> tuple[list[torch.Tensor], list[float]]:
    """Sum over examples of each example's own-loss gradient, clipped to ``clip`` (opacus' factor)."""
    x, mask, y = batch
    params = [p for _, p in _trainable(model)]
    total = [torch.zeros_like(p) for p in params]
    norms = []
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(model(x[i:i + 1], attention_mask=None if mask is None else mask[i:i + 1],
                                          labels=y[i:i + 1]).loss, params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
        norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))
        norms.append(norm)
        factor = min(1.0, clip / (norm + 1e-6))
        for t, g in zip(total, grads):
            t.add_(g, alpha=factor)
    return total, norms


def _dp_step(model: SplitModel, batch: tuple, **kwargs: object) -> tuple[PrivateTraining, list[torch.Tensor]]:
    """One DP-SGD step with plain SGD (lr 1); returns the weight deltas of the trainable client parameters."""
    params = [p for _, p in _trainable(model)]
    before = [p.detach().clone() for p in params]
    pt = PrivateTraining(model.client_modules(), torch.optim.SGD(params, lr=1.0), steps=1, **kwargs)
    x, mask, y = batch
    pt.optimizer.zero_grad(set_to_none=True)
    model(x, attention_mask=mask, labels=y).loss.backward()
    pt.optimizer.step()
    pt.close()
    return pt, [p.detach() - b for p, b in zip(params, before)]


# -- DP-SGD vs a manual per-example computation ---------------------------------------------------------
@pytest.mark.parametrize("kind", ["cnn", "gpt2", "llama", "gemma", "lora-gpt2", "lora-llama"])
def test_dp_sgd_step_equals_manual_per_example_clipping(kind: str) -> None:
    # Prepare
    model, _ = _split(kind)
    batch = _batch(kind)
    expected = copy.deepcopy(model)
    total, norms = _manual_clipped_sum(expected, batch, clip=1.0)
    clip = sorted(norms)[len(norms) // 2]  # about half of the examples get clipped
    total, _ = _manual_clipped_sum(expected, batch, clip=clip)
    # Execute: no noise; expected batch 5 while the batch has 4 (Poisson): divide by 5, not 4.
    _, deltas = _dp_step(model, batch, dataset_size=10, sample_rate=0.5, noise_multiplier=0.0, max_grad_norm=clip)
    # Assert: every trainable tensor (LoRA adapters included, opacus #820) moved by -sum(clipped) / 5.
    for (name, _), delta, t in zip(_trainable(model), deltas, total):
        torch.testing.assert_close(delta, -t / 5.0, rtol=1e-4, atol=1e-6, msg=f"{kind}: {name}")
    assert any(d.abs().max() > 0 for d in deltas)
    if kind.startswith("lora-"):  # frozen base weights stay put
        frozen = {n: p for n, p in model.client_modules().named_parameters() if not p.requires_grad}
        original = dict(expected.client_modules().named_parameters())
        assert frozen and all(torch.equal(p, original[n]) for n, p in frozen.items())


def test_dp_sgd_noise_has_the_configured_scale() -> None:
    model, _ = _split("cnn")
    batch = _batch("cnn", 6)
    total, _ = _manual_clipped_sum(copy.deepcopy(model), batch, clip=0.5)
    g = torch.Generator().manual_seed(0)
    _, deltas = _dp_step(model, batch, dataset_size=12, batch_size=6, noise_multiplier=2.0, max_grad_norm=0.5,
                         generator=g)
    noise = torch.cat([(d + t / 6.0).flatten() for d, t in zip(deltas, total)]) * 6.0
    assert noise.numel() > 2000
    assert abs(float(noise.mean())) < 0.1
    assert float(noise.std()) == pytest.approx(2.0 * 0.5, rel=0.06)


def test_dp_sgd_through_the_remote_trunk_uses_the_server_gradient(trunk_server) -> None:
    from splitfed.channel.client.remote import RemoteTrunk
    from splitfed.client.training import train

    # Prepare: manual per-example gradients with the trunk local, before the server holds it.
    local, parts = _split("cnn")
    batch = _batch("cnn", 5)
    total, norms = _manual_clipped_sum(copy.deepcopy(local), batch, clip=1.0)
    clip = sorted(norms)[2]
    total, _ = _manual_clipped_sum(copy.deepcopy(local), batch, clip=clip)
    seen: dict[str, torch.Tensor] = {}
    parts.trunk.register_forward_pre_hook(lambda m, args: seen.__setitem__("in", args[0].hidden.detach().clone()))
    server = trunk_server(parts.trunk, lr=0.01)
    remote = RemoteTrunk(f"127.0.0.1:{server.port}", insecure=True)
    model = SplitModel(parts.bottom, remote, parts.top, task="classification")
    params = [p for _, p in _trainable(model)]
    before = [p.detach().clone() for p in params]
    cut = CutNoise(activation_clip=1e6, sample_rate=0.5).install(model)  # clips nothing: exact
    pt = PrivateTraining(model.client_modules(), torch.optim.SGD(params, lr=1.0), dataset_size=10, sample_rate=0.5,
                         steps=1, noise_multiplier=0.0, max_grad_norm=clip)
    # Execute: the client loop as the runner calls it.
    try:
        report = train(model, pt.optimizer, iter([_as_batch(batch)]), 1)
    finally:
        pt.close()
        cut.remove()
        remote.close()
    # Assert: the bottom's update came from the gradient the server returned, clipped per example.
    assert report.steps == 1 and remote.outcomes.get("APPLIED") == 1
    assert seen["in"].shape == (5, 4, 14, 14)
    for (name, _), p, b, t in zip(_trainable(model), params, before, total):
        torch.testing.assert_close(p.detach() - b, -t / 5.0, rtol=1e-4, atol=1e-6, msg=name)
    assert cut.stats.forwards == 1 and cut.activation_accountant.steps == 1


def _as_batch(batch: tuple):
    from splitfed.data import Batch

    x, mask, y = batch
    return Batch(x, mask, y)


def test_unsupported_layers_raise_or_freeze() -> None:
    from peft import LoraConfig, get_peft_model

    model, _ = _split("llama")
    model.bottom = get_peft_model(model.bottom, LoraConfig(r=2, target_modules=["embed", "q_proj"]))
    opt = torch.optim.SGD(model.client_modules().parameters(), lr=0.1)
    with pytest.raises(UnsupportedModelError, match="LoRA adapter on an embedding.*target_modules"):
        PrivateTraining(model.client_modules(), opt, dataset_size=8, batch_size=2, steps=1, noise_multiplier=1.0)
    pt = PrivateTraining(model.client_modules(), opt, dataset_size=8, batch_size=2, steps=1, noise_multiplier=1.0,
                         unsupported="freeze")
    assert pt.frozen and all("lora_embedding" in n for n in pt.frozen)
    pt.close()
    bn = nn.ModuleDict({"bottom": nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))})
    with pytest.raises(UnsupportedModelError, match="BatchNorm2d"):
        PrivateTraining(bn, torch.optim.SGD(bn.parameters(), lr=0.1), dataset_size=8, batch_size=2, steps=1,
                        noise_multiplier=1.0)


def test_eval_mode_forward_gives_a_clear_error() -> None:
    model, _ = _split("cnn")
    x, _, y = _batch("cnn")
    pt = PrivateTraining(model.client_modules(), torch.optim.SGD(model.client_modules().parameters(), lr=0.1),
                         dataset_size=8, batch_size=4, steps=1, noise_multiplier=1.0)
    model.eval()
    with pytest.raises(ConfigError, match="model.train\\(\\)"):
        model(x, labels=y)
    with torch.no_grad():  # evaluation is fine
        model(x, labels=y)
    pt.close()
    model(x, labels=y)  # hooks are gone after close()


# -- accounting across rounds ----------------------------------------------------------------------------
def _opacus_epsilon(history: list[tuple[float, float, int]], delta: float = 1e-5) -> float:
    from opacus.accountants import PRVAccountant

    acc = PRVAccountant()
    acc.history = history
    return acc.get_epsilon(delta=delta)


def test_epsilon_grows_across_rounds_and_survives_a_config_record_round_trip() -> None:
    from flwr.app import ConfigRecord, RecordDict

    from splitfed.data import mnist

    data = mnist()["train"].select(range(64))
    context_state = RecordDict()  # what Flower keeps per node between rounds
    epsilons = []
    for _ in range(2):
        model, _ = _split("cnn")
        previous = context_state["privacy"] if "privacy" in context_state else None
        pt = PrivateTraining(model.client_modules(), torch.optim.SGD(model.client_modules().parameters(), lr=0.05),
                             dataset_size=len(data), batch_size=8, steps=3, noise_multiplier=1.1,
                             accountant_state=previous)
        for b in pt.batches(data, "image"):
            pt.optimizer.zero_grad(set_to_none=True)
            model(b.inputs, labels=b.labels).loss.backward()
            pt.optimizer.step()
        epsilons.append(pt.epsilon())
        context_state["privacy"] = ConfigRecord(pt.state_dict())
        pt.close()
    assert dict(context_state["privacy"]) == {"dp-accountant": "prv", "dp-noise-multipliers": [1.1],
                                              "dp-sample-rates": [0.125], "dp-steps": [6]}
    assert epsilons[0] == pytest.approx(_opacus_epsilon([(1.1, 0.125, 3)]), rel=1e-6)
    assert epsilons[1] == pytest.approx(_opacus_epsilon([(1.1, 0.125, 6)]), rel=1e-6)
    assert epsilons[1] > epsilons[0] > 0


def test_target_epsilon_is_met_and_then_refused() -> None:
    model, _ = _split("cnn")
    parts = model.client_modules()
    state: dict = {}
    sigma = noise_for_epsilon(4.0, 1e-5, 0.1, 6, "rdp")
    for _ in range(2):
        pt = PrivateTraining(parts, torch.optim.SGD(parts.parameters(), lr=0.1), dataset_size=50, sample_rate=0.1,
                             steps=3, planned_steps=6, target_epsilon=4.0, accountant_state=state, accountant="rdp")
        assert pt.noise_multiplier == sigma
        for _ in range(3):
            pt.noise_only_step()  # an empty Poisson draw: noise only, but a step of the mechanism
        state = pt.state_dict()
        pt.close()
    assert Accountant("rdp", state=state).epsilon() == pytest.approx(4.0, abs=0.02)
    assert Accountant("rdp", state=state).epsilon() <= 4.0
    with pytest.raises(PrivacyBudgetError, match="above the target 4"):
        PrivateTraining(parts, torch.optim.SGD(parts.parameters(), lr=0.1), dataset_size=50, sample_rate=0.1,
                        steps=3, planned_steps=6, target_epsilon=4.0, accountant_state=state, accountant="rdp")


def test_an_empty_draw_after_a_real_step_takes_a_noise_only_step() -> None:
    """Training loops zero gradients before backward, so an empty Poisson draw meets the last step's gradients."""
    from splitfed.data import mnist
    from splitfed.client.training import train

    data = mnist()["train"].select(range(40))
    model, _ = _split("cnn")
    parts = model.client_modules()
    pt = PrivateTraining(parts, torch.optim.SGD(parts.parameters(), lr=0.05), dataset_size=len(data),
                         sample_rate=0.2, steps=3, noise_multiplier=1.0, generator=torch.Generator().manual_seed(0))
    draws = iter([torch.arange(8).numpy(), torch.arange(0).numpy(), torch.arange(8, 16).numpy()])
    before: list[torch.Tensor] = []

    def sample() -> object:
        before[:] = [p.detach().clone() for p in parts.parameters()]
        return next(draws)

    noised_steps: list[bool] = []

    def noised() -> None:  # the empty draw's step moved every trainable parameter by noise alone
        noised_steps.append(all(not torch.equal(b, p) for b, p in zip(before, parts.parameters())))

    pt.sample = sample  # type: ignore[method-assign]
    report = train(model, pt.optimizer, pt.batches(data, "image", on_empty=noised), 3)
    assert report.steps == 2 and pt.empty_steps == 1
    assert noised_steps == [True]  # the callback ran, once, and saw every parameter moved
    assert pt.accountant.steps == 3
    pt.close()


def test_accountant_state_checks() -> None:
    acc = Accountant(delta=1e-5)
    assert acc.epsilon() == 0.0
    acc.step(0.0, 0.1)
    assert math.isinf(acc.epsilon())
    with pytest.raises(ConfigError, match="accountant"):
        Accountant("rdp", state={"dp-accountant": "prv", "dp-noise-multipliers": [1.0], "dp-sample-rates": [0.1],
                                 "dp-steps": [1]})
    with pytest.raises(ConfigError, match="dp-target-epsilon"):
        noise_for_epsilon(0.0, 1e-5, 0.1, 10)


# -- noise at the cut --------------------------------------------------------------------------------------
def test_clip_and_noise_clips_rows_and_scales_noise() -> None:
    x = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    out, norms = clip_and_noise(x, 1.0, 0.0)
    torch.testing.assert_close(norms, torch.tensor([5.0, 0.5, 0.0]))
    torch.testing.assert_close(out, torch.tensor([[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]]))
    # A mean-loss gradient (rows scaled by 1/B) is clipped as its example's own gradient.
    out, norms = clip_and_noise(x / 3, 1.0, 0.0, scale=3.0)
    torch.testing.assert_close(out * 3, torch.tensor([[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]]))
    g = torch.Generator().manual_seed(0)
    noised, _ = clip_and_noise(torch.zeros(64, 4, 32), 2.0, 0.5, generator=g)
    assert float(noised.std()) == pytest.approx(1.0, rel=0.03)
    with pytest.raises(ConfigError, match="clip"):
        clip_and_noise(x, 0.0, 1.0)


def test_cut_noise_clips_what_the_server_sees_and_accounts_for_it() -> None:
    model, parts = _split("cnn")
    x, _, y = _batch("cnn", 8)
    seen: dict[str, torch.Tensor] = {}

    def on_trunk(module: nn.Module, args: tuple, out: CutState) -> None:
        seen["activation"] = args[0].hidden.detach()
        if out.hidden.requires_grad:
            out.hidden.register_hook(lambda g: seen.__setitem__("gradient", g.detach()))

    parts.trunk.register_forward_hook(on_trunk)
    cut = CutNoise(activation_clip=0.5, gradient_clip=0.01, sample_rate=0.25).install(model)
    model(x, labels=y).loss.backward()
    # Every example's activation has norm <= 0.5 (sigma 0: exactly 0.5 for the clipped ones).
    act = seen["activation"].flatten(1).norm(dim=1)
    assert (cut.stats.activation_norms > 0.5).all()
    torch.testing.assert_close(act, torch.full((8,), 0.5))
    # The gradient sent back is clipped per example's own loss: batch * row norm <= clip.
    grad = seen["gradient"].flatten(1).norm(dim=1) * 8
    assert (grad <= 0.01 + 1e-6).all() and cut.stats.gradient_norms is not None
    assert cut.stats.forwards == cut.stats.backwards == 1
    cut.remove()
    # With noise: std sigma * C around the clipped activation; accounted as the subsampled Gaussian.
    cut = CutNoise(activation_clip=0.5, activation_sigma=2.0, gradient_clip=0.01, gradient_sigma=1.0,
                   sample_rate=0.25, generator=torch.Generator().manual_seed(1)).install(model)
    for _ in range(3):
        model(x, labels=y).loss.backward()
    clean = model.bottom(x).hidden  # hooks are on: clipped + noised again; compare the noise only
    noisy = seen["activation"]
    assert float((noisy - noisy.mean()).std()) == pytest.approx(1.0, rel=0.1)
    assert clean.shape == noisy.shape
    assert cut.epsilon() == pytest.approx(_opacus_epsilon([(2.0, 0.25, 4)]), rel=1e-6)  # 3 + the extra forward
    assert cut.gradient_epsilon() == pytest.approx(_opacus_epsilon([(1.0, 0.25, 3)]), rel=1e-6)
    restored = CutNoise(activation_clip=0.5, activation_sigma=2.0, sample_rate=0.25, state=cut.state_dict())
    assert restored.epsilon() == cut.epsilon()
    model.eval()  # evaluation forwards are noised (the server sees them) but not accounted
    with torch.no_grad():
        model(x, labels=y)
    assert cut.activation_accountant.steps == 4
    cut.remove()


def test_privacy_config_reads_run_config_keys() -> None:
    cfg = PrivacyConfig.from_mapping({"dp-target-epsilon": 8, "dp-delta": 1e-5, "cut-noise-clip": 2,
                                      "cut-noise-sigma": 0.5, "cut-noise-eval": "false", "lr": 0.1})
    assert cfg.dp_sgd and cfg.cut_noise and cfg.enabled and cfg.cut_noise_eval is False
    assert not PrivacyConfig.from_mapping({}).enabled
    assert set(PrivacyConfig.keys()) >= {"dp-noise-multiplier", "dp-target-epsilon", "dp-max-grad-norm", "dp-delta",
                                         "cut-noise-clip", "cut-noise-sigma", "cut-grad-clip", "cut-grad-sigma"}
    for bad, fragment in [({"dp-noise-multiplier": 1, "dp-target-epsilon": 8}, "not both"),
                          ({"cut-noise-sigma": 1.0}, "cut-noise-clip"), ({"dp-delta": 2}, "dp-delta"),
                          ({"dp-max-grad-norm": "x"}, "dp-max-grad-norm"), ({"dp-accountant": "gdp"}, "dp-accountant")]:
        with pytest.raises(ConfigError, match=fragment):
            PrivacyConfig.from_mapping(bad)


def test_client_privacy_round_gives_metrics_and_state() -> None:
    from splitfed.data import mnist
    from splitfed.client.training import train

    data = mnist()["train"].select(range(80))
    model, _ = _split("cnn")
    config = PrivacyConfig(dp_noise_multiplier=1.0, cut_noise_clip=5.0, cut_noise_sigma=1.0, cut_grad_clip=1.0,
                           cut_grad_sigma=1.0)
    opt = torch.optim.SGD(model.client_modules().parameters(), lr=0.05)
    with ClientPrivacy(config, model, opt, dataset_size=len(data), batch_size=8, steps=4, seed=0) as privacy:
        report = train(model, privacy.optimizer, privacy.batches(data, "image"), 4, before_step=privacy.before_step)
        metrics = privacy.metrics()
        state = privacy.state_dict()
    assert report.steps + privacy.dp.empty_steps == 4
    assert set(metrics) == {"train-epsilon", "train-dp-noise-multiplier", "train-cut-epsilon",
                            "train-cut-grad-epsilon"}
    assert metrics["train-epsilon"] == pytest.approx(_opacus_epsilon([(1.0, 0.1, 4)]), rel=1e-6)
    assert state["dp-steps"] == [4] and state["cut-steps"] == [4] and state["cut-grad-steps"] == [4]
    assert privacy.expected_examples() == 32


# -- central DP on the aggregate: Flower's wrappers around SplitFed ------------------------------------------
def _spy_fedavg() -> object:
    """A FedAvg that records the client parts it is asked to aggregate (after any DP clipping)."""
    from flwr.serverapp.strategy import FedAvg

    from strategies.metrics import aggregate_split_metrics

    class SpyFedAvg(FedAvg):
        def __init__(self) -> None:
            super().__init__(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=2, min_evaluate_nodes=0,
                             min_available_nodes=2, train_metrics_aggr_fn=aggregate_split_metrics)
            self.seen: list[list[dict[str, torch.Tensor]]] = []

        def aggregate_train(self, server_round, replies):  # type: ignore[no-untyped-def]
            replies = list(replies)
            self.seen.append([r.content["arrays"].to_torch_state_dict() for r in replies if not r.has_error()])
            return super().aggregate_train(server_round, replies)

    return SpyFedAvg()


def _run_strategy(tmp_path, strategy: object, client_app: object, rounds: int = 1, num_nodes: int = 2):
    """What apps/server_app.py does, with ``strategy`` inside SplitFed, over the in-process Grid."""
    from flower_harness import SUPERLINK_NODE, ThreadGrid, default_run_config
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.supercore.task_identity import TaskIdentity

    from splitfed.config import RunConfig
    from splitfed.run.server import ServerRunner
    from strategies import SplitFed

    config = default_run_config(output_dir=str(tmp_path / "out"), num_server_rounds=rounds, local_steps=3)
    cfg = RunConfig.from_mapping(config)
    grid = ThreadGrid(client_app, num_nodes, config, concurrency=2)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = grid.run_id, SUPERLINK_NODE, 1
    runner = ServerRunner(cfg, run_id=str(grid.run_id), output_dir=tmp_path / "out").start()
    try:
        initial = ArrayRecord(torch_state_dict=runner.client_state).to_torch_state_dict()
        result = SplitFed(strategy, runner).start(  # type: ignore[arg-type]
            grid, ArrayRecord(torch_state_dict=runner.client_state), num_rounds=rounds,
            train_config=ConfigRecord({"lr": cfg.lr}), evaluate_config=ConfigRecord())
    finally:
        runner.stop()
        grid.close()
    return initial, result


def _update_norm(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum(((after[k].double() - before[k].double()) ** 2).sum() for k in before)))


def test_server_side_central_dp_clips_and_noises_the_client_parts(tmp_path) -> None:
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping

    from apps.client_app import app as client_app

    inner = _spy_fedavg()
    clip, sigma = 0.05, 0.5
    strategy = DifferentialPrivacyServerSideFixedClipping(inner, noise_multiplier=sigma, clipping_norm=clip,
                                                          num_sampled_clients=2)
    initial, result = _run_strategy(tmp_path, strategy, client_app)
    replies = inner.seen[0]
    assert len(replies) == 2
    norms = [_update_norm(r, initial) for r in replies]
    assert all(n == pytest.approx(clip, rel=1e-3) for n in norms)  # 3 SGD steps move far more than 0.05: clipped
    mean = {k: (replies[0][k] + replies[1][k]) / 2 for k in initial}
    final = result.arrays.to_torch_state_dict()
    noise = torch.cat([(final[k] - mean[k]).flatten() for k in initial])
    assert float(noise.std()) == pytest.approx(sigma * clip / 2, rel=0.05)  # Flower's stdv: sigma * C / clients
    assert result.train_metrics_clientapp[1]["num-examples"] == 2 * 3 * 32  # both clients took their 3 steps


def test_client_side_central_dp_clips_on_the_client(tmp_path) -> None:
    """Flower's fixedclipping_mod, registered as Flower documents it, on the SplitFed ClientApp (evaluate rounds
    run too: tests/test_flower_mods.py)."""
    from flwr.clientapp.mod import fixedclipping_mod
    from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping

    from apps.client_app import make_client_app

    app = make_client_app(train_mods=[fixedclipping_mod])
    inner = _spy_fedavg()
    strategy = DifferentialPrivacyClientSideFixedClipping(inner, noise_multiplier=0.0, clipping_norm=0.05,
                                                          num_sampled_clients=2)
    initial, result = _run_strategy(tmp_path, strategy, app)
    norms = [_update_norm(r, initial) for r in inner.seen[0]]
    assert len(norms) == 2 and all(n == pytest.approx(0.05, rel=1e-3) for n in norms)
    assert _update_norm(result.arrays.to_torch_state_dict(), initial) <= 0.05 + 1e-6


def test_private_client_app_keeps_the_accountant_in_context_state(tmp_path) -> None:
    """The real ServerApp and ClientApp with DP-SGD and cut noise set in the run config."""
    import json

    from flower_harness import run_apps

    grid, out = run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=2, local_steps=3, batch_size=16,
                         dp_noise_multiplier=1.0, cut_noise_clip=20.0, cut_noise_sigma=0.01)
    states = {n: dict(c.state["splitfed-privacy"]) for n, c in grid.contexts.items()
              if "splitfed-privacy" in c.state}
    assert len(states) == 2
    # 3 steps in each of 2 rounds, accounted across fresh client models (the state lives in context.state).
    assert sorted({sum(s.get("dp-steps", [])) for s in states.values()}) == [6]
    rounds = json.loads((out / "history.json").read_text())["rounds"]
    q = 16 / 2000  # each of 2 clients holds 2,000 training images
    assert rounds[-1]["train"]["train-epsilon"] == pytest.approx(_opacus_epsilon([(1.0, q, 6)]), rel=1e-6)
    assert rounds[0]["train"]["train-epsilon"] < rounds[1]["train"]["train-epsilon"]
    assert rounds[-1]["train"]["train-dp-noise-multiplier"] == 1.0 and "train-cut-epsilon" in rounds[-1]["train"]
    assert (out / "epsilon.png").exists()
