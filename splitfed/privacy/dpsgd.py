"""DP-SGD on the client parts (bottom and top) with opacus: per-example clipping, Gaussian noise, accounting.

The client's bottom -> RemoteTrunk -> top is one autograd graph, so opacus'
hooks on the bottom see the gradient the trunk server returned, exactly as if
the trunk were local. :class:`PrivateTraining` attaches those hooks to the
client parts (no wrapper module: state-dict names do not change), wraps the
optimizer in opacus' ``DPOptimizer``, samples Poisson batches (the sampling
the accountant assumes) and keeps the accountant's state as plain lists.

Supported: every layer opacus has a grad sampler for (Linear, Conv2d,
Embedding, LayerNorm, RMSNorm, ...) plus everything else through opacus'
functorch fallback (GPT-2's ``Conv1D``, peft LoRA ``Linear`` adapters); Gemma's
scaled embedding gets a grad sampler here. Not supported (raise, or freeze with
``unsupported="freeze"``): LoRA on embeddings and trainable layers that keep
buffers (BatchNorm).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from splitfed.data import Batch, collate
from splitfed.errors import ConfigError, PrivacyBudgetError, UnsupportedModelError
from splitfed.privacy.accounting import Accountant, StateValue, noise_for_epsilon

log = logging.getLogger(__name__)

#: torch warns when a full backward hook fires on a module none of whose inputs needs a gradient: opacus' hooks on
#: a client's first layer, whose input is the data. The per-example gradients of its weights are computed from its
#: input and output gradient all the same (``tests/test_privacy.py`` checks them), so the warning says nothing.
_FIRST_LAYER_HOOK_WARNING = "Full backward hook is firing when gradients are computed with respect to module outputs"

Unsupported = Literal["error", "freeze"]


# -- what opacus can and cannot do ------------------------------------------------------
def _scaled_embedding_grad_sample(layer: nn.Embedding, activations: list[torch.Tensor], backprops: torch.Tensor
                                  ) -> dict[nn.Parameter, torch.Tensor]:
    """Per-example gradients of ``embedding(ids) * embed_scale`` (Gemma): the embedding's, scaled."""
    from opacus.grad_sample.embedding import compute_embedding_grad_sample

    return compute_embedding_grad_sample(layer, activations, backprops * layer.embed_scale.to(backprops.dtype))


def _is_scaled_embedding(module: nn.Module) -> bool:
    buffers = dict(module.named_buffers(recurse=False))
    return isinstance(module, nn.Embedding) and set(buffers) == {"embed_scale"} and buffers["embed_scale"].numel() == 1


def _is_lora_embedding(module: nn.Module) -> bool:
    """A peft LoRA layer with trainable embedding adapters (every LoRA layer has the dicts, most empty)."""
    adapters = [getattr(module, name, None) for name in ("lora_embedding_A", "lora_embedding_B")]
    return any(isinstance(a, nn.ParameterDict) and any(p.requires_grad for p in a.parameters()) for a in adapters)


def prepare_for_opacus(parts: nn.Module, unsupported: Unsupported = "error") -> list[str]:
    """Check that opacus can compute per-example gradients of every trainable parameter of ``parts``.

    Registers a grad sampler for scaled embeddings (Gemma). LoRA adapters on
    embeddings and trainable layers with buffers (BatchNorm) cannot be handled:
    with ``unsupported="error"`` this raises
    :class:`~splitfed.errors.UnsupportedModelError` naming them, with
    ``"freeze"`` their parameters are frozen (not trained) and their names returned.
    """
    from opacus.grad_sample import GradSampleModule
    from opacus.grad_sample.utils import register_grad_sampler

    bad: list[tuple[str, nn.Module, str]] = []
    for name, module in parts.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if _is_lora_embedding(module):
            bad.append((name, module, "LoRA adapter on an embedding"))
            continue
        if not own:
            continue
        if _is_scaled_embedding(module):
            if type(module) not in GradSampleModule.GRAD_SAMPLERS:
                register_grad_sampler(type(module))(_scaled_embedding_grad_sample)
            continue
        if any(True for _ in module.buffers(recurse=False)):
            bad.append((name, module, "trainable layer with buffers"))
    if not bad:
        return []
    listing = ", ".join(f"{n} ({type(m).__name__}: {why})" for n, m, why in bad)
    if unsupported == "error":
        raise UnsupportedModelError(
            f"opacus cannot compute per-example gradients for: {listing}. Remove embeddings from the LoRA "
            "target_modules, replace BatchNorm by GroupNorm/LayerNorm, or pass unsupported='freeze' to freeze "
            "these layers (they are then not trained).")
    frozen = []
    for name, module, _ in bad:
        for pname, p in module.named_parameters():
            if p.requires_grad:
                p.requires_grad_(False)
                frozen.append(f"{name}.{pname}" if name else pname)
    log.warning("DP-SGD: froze %d parameter(s) opacus cannot handle: %s", len(frozen), listing)
    return frozen


# -- the optimizer --------------------------------------------------------------------------
def _dp_optimizer_class(names: dict[int, str]) -> type:
    from opacus.optimizers import DPOptimizer

    class SplitDPOptimizer(DPOptimizer):
        """opacus' DPOptimizer with a clear error when a parameter has no per-example gradient."""

        def pre_step(self, closure: Callable[[], float] | None = None) -> bool | None:
            missing = [names.get(id(p), "<not in the client parts>") for p in self.params
                       if getattr(p, "grad_sample", None) is None]
            if missing:
                raise ConfigError(
                    f"{len(missing)} trainable parameter(s) got no per-example gradient this step "
                    f"({', '.join(missing[:5])}). Run forward and backward in train() mode (opacus skips "
                    "eval-mode forwards), give the optimizer only the client parts' parameters, and freeze "
                    "parameters the loss does not reach (requires_grad_(False)) before creating PrivateTraining.")
            return super().pre_step(closure)

    return SplitDPOptimizer


class PrivateTraining:
    """DP-SGD for the client's bottom and top parts.

    Args:
        parts: the client parts (``SplitModel.client_modules()``); must run in train() mode.
        optimizer: an optimizer over ``parts``' parameters; :attr:`optimizer` wraps it.
        dataset_size: examples in the client's training shard (privacy is per example of it).
        sample_rate: Poisson sampling rate per step; or give ``batch_size`` (expected batch).
        steps: optimizer steps this round (what :meth:`batches` yields).
        noise_multiplier: noise std / ``max_grad_norm``; or ``target_epsilon`` to derive it.
        target_epsilon: epsilon to reach after ``planned_steps`` steps (all rounds); the noise
            comes from opacus' ``get_noise_multiplier``, and a round that would exceed the
            target raises :class:`~splitfed.errors.PrivacyBudgetError`.
        planned_steps: steps over the whole run (default: ``steps``).
        max_grad_norm: per-example gradient clip norm.
        delta: the delta epsilon is reported at.
        accountant: ``prv`` or ``rdp``.
        accountant_state: a previous :meth:`state_dict` (from Flower's ``context.state``).
        loss_reduction: ``mean`` (the loss is a batch mean) or ``sum``.
        unsupported: ``error`` or ``freeze`` layers opacus cannot handle (see :func:`prepare_for_opacus`).
        after_noise: called after clipping and noising, before the optimizer's step (e.g. FedProx's
            proximal term: it sees no data, so privacy is unchanged).
        generator: random source of the noise and the sampling (default: fresh, unseeded).
    """

    def __init__(self, parts: nn.Module, optimizer: torch.optim.Optimizer, *, dataset_size: int,
                 steps: int, sample_rate: float | None = None, batch_size: int | None = None,
                 noise_multiplier: float | None = None, target_epsilon: float | None = None,
                 planned_steps: int | None = None, max_grad_norm: float = 1.0, delta: float = 1e-5,
                 accountant: str = "prv", accountant_state: Mapping[str, Any] | None = None,
                 loss_reduction: str = "mean", unsupported: Unsupported = "error",
                 after_noise: Callable[[], None] | None = None, generator: torch.Generator | None = None) -> None:
        from opacus.grad_sample import GradSampleHooks

        if dataset_size < 1:
            raise ConfigError("the client's data shard is empty; DP-SGD needs at least one example")
        if (sample_rate is None) == (batch_size is None):
            raise ConfigError("give exactly one of sample_rate and batch_size")
        self.sample_rate = float(sample_rate if sample_rate is not None else batch_size / dataset_size)
        if not 0 < self.sample_rate <= 1:
            raise ConfigError(f"sample rate {self.sample_rate:.4g} is outside (0, 1]; lower batch-size below the "
                              f"shard's {dataset_size} examples")
        if not max_grad_norm > 0:
            raise ConfigError(f"dp-max-grad-norm must be > 0, got {max_grad_norm}")
        if loss_reduction not in ("mean", "sum"):
            raise ConfigError(f"loss_reduction must be mean or sum, got {loss_reduction!r}")
        if steps < 1:
            raise ConfigError(f"steps must be >= 1, got {steps}")
        self.dataset_size = dataset_size
        self.steps = steps
        self.planned_steps = planned_steps or steps
        self.delta = delta
        self.max_grad_norm = float(max_grad_norm)
        self.target_epsilon = target_epsilon or None
        self.accountant = Accountant(accountant, delta, prefix="dp", state=accountant_state)
        if self.target_epsilon is not None:
            if noise_multiplier:
                raise ConfigError("set either dp-noise-multiplier or dp-target-epsilon, not both")
            noise_multiplier = noise_for_epsilon(self.target_epsilon, delta, self.sample_rate, self.planned_steps,
                                                 accountant)
            projected = self.accountant.projected(noise_multiplier, self.sample_rate, steps)
            if projected > self.target_epsilon * 1.001:
                raise PrivacyBudgetError(
                    f"this round would bring epsilon to {projected:.3g} (delta {delta:g}), above the target "
                    f"{self.target_epsilon:g}: {self.accountant.steps} of the {self.planned_steps} planned steps "
                    "are spent. Stop training this client, or plan more steps (rounds x local steps) for the run.")
        if noise_multiplier is None or noise_multiplier < 0:
            raise ConfigError("DP-SGD needs dp-noise-multiplier >= 0 or dp-target-epsilon > 0")
        self.noise_multiplier = float(noise_multiplier)
        self.parts = parts
        self.frozen = prepare_for_opacus(parts, unsupported)
        self.generator = generator or torch.Generator()
        if generator is None:
            self.generator.seed()
        # Process-wide (backward may run on another thread), and only this message.
        warnings.filterwarnings("ignore", message=_FIRST_LAYER_HOOK_WARNING, category=UserWarning)
        self._hooks = GradSampleHooks(parts, loss_reduction=loss_reduction, strict=False)
        self.expected_batch_size = self.sample_rate * dataset_size
        names = {id(p): n for n, p in parts.named_parameters()}
        self.optimizer = _dp_optimizer_class(names)(
            optimizer, noise_multiplier=self.noise_multiplier, max_grad_norm=self.max_grad_norm,
            expected_batch_size=self.expected_batch_size, loss_reduction=loss_reduction, generator=self.generator)
        self._after_noise = after_noise
        self.optimizer.attach_step_hook(self._on_step)
        self._mode_checks = [child.register_forward_pre_hook(self._check_mode) for child in parts.children()]
        self.empty_steps = 0
        log.info("DP-SGD on %s parameters: noise multiplier %.4g, clip %.4g, sample rate %.4g, %d steps "
                 "(%d composed before)", sum(p.numel() for p in parts.parameters() if p.requires_grad),
                 self.noise_multiplier, self.max_grad_norm, self.sample_rate, steps, self.accountant.steps)

    @staticmethod
    def _check_mode(module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and not module.training:
            raise ConfigError(f"{type(module).__name__} runs with gradients in eval() mode: opacus then records no "
                              "per-example gradients. Call model.train() before training steps (or evaluate "
                              "under torch.no_grad()).")

    def _on_step(self, optimizer: Any) -> None:
        self.accountant.step(self.noise_multiplier, self.sample_rate * optimizer.accumulated_iterations)
        if self._after_noise is not None:
            self._after_noise()

    # -- data -----------------------------------------------------------------------------
    def sample(self) -> np.ndarray:
        """One Poisson sample: each index of the shard independently with probability ``sample_rate``."""
        mask = torch.rand(self.dataset_size, generator=self.generator) < self.sample_rate
        return mask.nonzero().flatten().numpy()

    def batches(self, dataset: Any, kind: str, on_empty: Callable[[], None] | None = None) -> Iterator[Batch]:
        """``steps`` Poisson batches of ``dataset`` (a ``datasets.Dataset``, collated by ``splitfed.data.collate``).

        A draw that comes out empty is still a step of the mechanism: the
        optimizer takes a noise-only step here (and ``on_empty`` is called), and
        the draw counts towards ``steps``.
        """
        if len(dataset) != self.dataset_size:
            raise ConfigError(f"dataset has {len(dataset)} examples but PrivateTraining was built for "
                              f"{self.dataset_size}")
        for _ in range(self.steps):
            index = self.sample()
            if len(index) == 0:
                self.noise_only_step()
                if on_empty is not None:
                    on_empty()
                continue
            yield collate(dataset[index], kind)

    def noise_only_step(self) -> None:
        """An optimizer step on an empty batch: zero clipped sum plus noise (keeps the accounting exact).

        The previous step's gradients are cleared first: training loops zero
        gradients before their backward, so after a real step they are still
        there, marked as used, and opacus refuses to step on them again.
        """
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.optimizer.params:
            p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.empty_steps += 1

    # -- privacy spent ----------------------------------------------------------------------
    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent by this client so far (all rounds whose state was loaded, and this one)."""
        return self.accountant.epsilon(delta)

    def state_dict(self) -> dict[str, StateValue]:
        """The accountant's state: ``dp-accountant``, ``dp-noise-multipliers``, ``dp-sample-rates``, ``dp-steps``."""
        return self.accountant.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the accountant's state."""
        self.accountant.load_state_dict(state)

    def close(self) -> None:
        """Remove opacus' hooks and attributes from the parts (they then train as usual again)."""
        for handle in self._mode_checks:
            handle.remove()
        self._mode_checks = []
        if self._hooks is not None:
            self._hooks.cleanup()
            self._hooks = None

    def __enter__(self) -> PrivateTraining:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
