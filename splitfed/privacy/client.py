"""Everything a client round needs for privacy, from run-config keys: DP-SGD, cut noise, accounting, state.

:class:`PrivacyConfig` reads the ``dp-*`` and ``cut-*`` run-config keys;
:class:`ClientPrivacy` sets up the mechanisms on a :class:`~splitfed.split.SplitModel`
and hands the client loop its optimizer and batches, so integrating privacy into
``client_train`` is a few lines (see ``docs/privacy.md``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from splitfed.data import Batch, collate
from splitfed.errors import ConfigError
from splitfed.privacy.accounting import MECHANISMS, StateValue
from splitfed.privacy.cut import CutNoise
from splitfed.privacy.dpsgd import PrivateTraining

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrivacyConfig:
    """Privacy settings of a run. Field ``foo_bar`` is run-config key ``foo-bar``; all off by default."""

    dp_noise_multiplier: float = 0.0  # DP-SGD noise std / clip; 0 with dp-target-epsilon 0: DP-SGD off
    dp_target_epsilon: float = 0.0  # >0: derive the noise to spend this over the run's planned steps
    dp_max_grad_norm: float = 1.0  # per-example gradient clip norm of DP-SGD
    dp_delta: float = 1e-5  # delta all epsilons are reported at
    dp_accountant: str = "prv"  # prv or rdp
    dp_unsupported: str = "error"  # error or freeze: layers opacus cannot handle (LoRA on embeddings)
    cut_noise_clip: float = 0.0  # per-example L2 clip of the activations sent to the server; 0: off
    cut_noise_sigma: float = 0.0  # their noise std / cut-noise-clip
    cut_noise_eval: bool = True  # noise activations in evaluation too (the server sees them)
    cut_grad_clip: float = 0.0  # per-example L2 clip of the gradients sent to the server (labels); 0: off
    cut_grad_sigma: float = 0.0  # their noise std / cut-grad-clip

    @classmethod
    def keys(cls) -> dict[str, Any]:
        """Run-config keys and their defaults."""
        return {f.name.replace("_", "-"): f.default for f in dataclasses.fields(cls)}

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> PrivacyConfig:
        """Read the privacy keys of a run config (kebab-case); other keys are ignored."""
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            key = f.name.replace("_", "-")
            if key not in values:
                continue
            value = values[key]
            try:
                if isinstance(f.default, bool):
                    if isinstance(value, str):
                        if value.lower() not in ("true", "false", "1", "0"):
                            raise ValueError(value)
                        value = value.lower() in ("true", "1")
                    kwargs[f.name] = bool(value)
                else:
                    kwargs[f.name] = type(f.default)(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{key} must be a {type(f.default).__name__}, got {value!r}") from None
        config = cls(**kwargs)
        config.validate()
        return config

    def validate(self) -> None:
        """Check ranges and choices; raise ConfigError naming the key."""
        for key, value in [("dp-noise-multiplier", self.dp_noise_multiplier),
                           ("dp-target-epsilon", self.dp_target_epsilon), ("cut-noise-clip", self.cut_noise_clip),
                           ("cut-noise-sigma", self.cut_noise_sigma), ("cut-grad-clip", self.cut_grad_clip),
                           ("cut-grad-sigma", self.cut_grad_sigma)]:
            if value < 0:
                raise ConfigError(f"{key} must be >= 0, got {value}")
        if self.dp_noise_multiplier > 0 and self.dp_target_epsilon > 0:
            raise ConfigError("set dp-noise-multiplier or dp-target-epsilon, not both")
        if not self.dp_max_grad_norm > 0:
            raise ConfigError(f"dp-max-grad-norm must be > 0, got {self.dp_max_grad_norm}")
        if not 0 < self.dp_delta < 1:
            raise ConfigError(f"dp-delta must be in (0, 1), got {self.dp_delta}")
        if self.dp_accountant not in MECHANISMS:
            raise ConfigError(f"dp-accountant must be one of {', '.join(MECHANISMS)}; got {self.dp_accountant!r}")
        if self.dp_unsupported not in ("error", "freeze"):
            raise ConfigError(f"dp-unsupported must be error or freeze; got {self.dp_unsupported!r}")
        if self.cut_noise_sigma > 0 and self.cut_noise_clip == 0:
            raise ConfigError("cut-noise-sigma needs cut-noise-clip > 0 (the noise is sigma times the clip norm)")
        if self.cut_grad_sigma > 0 and self.cut_grad_clip == 0:
            raise ConfigError("cut-grad-sigma needs cut-grad-clip > 0 (the noise is sigma times the clip norm)")

    @property
    def dp_sgd(self) -> bool:
        """Whether DP-SGD is on."""
        return self.dp_noise_multiplier > 0 or self.dp_target_epsilon > 0

    @property
    def cut_noise(self) -> bool:
        """Whether activations or gradients at the cut are clipped (and noised)."""
        return self.cut_noise_clip > 0 or self.cut_grad_clip > 0

    @property
    def enabled(self) -> bool:
        """Whether any mechanism is on."""
        return self.dp_sgd or self.cut_noise

    def cut_noise_module(self, sample_rate: float | None = None, state: Mapping[str, Any] | None = None,
                         generator: torch.Generator | None = None) -> CutNoise | None:
        """The :class:`CutNoise` these settings describe (None when off)."""
        if not self.cut_noise:
            return None
        return CutNoise(activation_clip=self.cut_noise_clip, activation_sigma=self.cut_noise_sigma,
                        gradient_clip=self.cut_grad_clip, gradient_sigma=self.cut_grad_sigma, sample_rate=sample_rate,
                        delta=self.dp_delta, accountant=self.dp_accountant, state=state, in_eval=self.cut_noise_eval,
                        generator=generator)


class ClientPrivacy:
    """A client round with privacy: DP-SGD optimizer, cut-noise hooks, Poisson batches and the accountants.

    Args:
        config: the privacy settings.
        model: the client's split model (bottom, remote trunk, top).
        optimizer: the optimizer over the client parts.
        dataset_size: examples in the client's training shard.
        batch_size: expected batch size (sample rate = batch_size / dataset_size).
        steps: steps this round; ``planned_steps``: over the whole run (for ``dp-target-epsilon``).
        state: the accountants' state from previous rounds (Flower ``context.state``), or None.
        after_noise: a ``before_step`` callable (FedProx's proximal term); with DP-SGD it runs after
            the noise, else it becomes :attr:`before_step`.
        seed: seeds sampling and noise (None: fresh randomness, as DP needs in production).
    """

    def __init__(self, config: PrivacyConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 dataset_size: int, batch_size: int, steps: int, planned_steps: int | None = None,
                 state: Mapping[str, Any] | None = None, after_noise: Callable[[], None] | None = None,
                 seed: int | None = None) -> None:
        if dataset_size < 1:
            raise ConfigError("this client's data shard is empty; privacy needs at least one example")
        from splitfed.extras import require

        require("opacus", "differential privacy (the dp-* and cut-* run-config keys)")
        self.config = config
        self.model = model
        self.dataset_size = dataset_size
        self.steps = steps
        self.sample_rate = min(batch_size / dataset_size, 1.0)
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        state = dict(state or {})
        self.dp: PrivateTraining | None = None
        if config.dp_sgd and hasattr(model.trunk, "gpu_pipeline"):
            model.trunk.gpu_pipeline = False  # opacus' hooks expect the bottom's backward in the one graph
        if config.dp_sgd:
            self.dp = PrivateTraining(
                model.client_modules(), optimizer, dataset_size=dataset_size, sample_rate=self.sample_rate,
                steps=steps, noise_multiplier=config.dp_noise_multiplier or None,
                target_epsilon=config.dp_target_epsilon or None, planned_steps=planned_steps,
                max_grad_norm=config.dp_max_grad_norm, delta=config.dp_delta, accountant=config.dp_accountant,
                accountant_state=state, unsupported=config.dp_unsupported,  # type: ignore[arg-type]
                after_noise=after_noise, generator=self.generator)
        try:
            self.cut = config.cut_noise_module(self.sample_rate, state, self.generator)
            if self.cut is not None:
                self.cut.install(model)
        except Exception:
            if self.dp is not None:
                self.dp.close()
            raise
        #: The optimizer the client loop steps: opacus' DPOptimizer with DP-SGD on, else the one given.
        self.optimizer: torch.optim.Optimizer = self.dp.optimizer if self.dp is not None else optimizer
        #: The client loop's ``before_step``: None with DP-SGD (the DP optimizer runs it after the noise).
        self.before_step: Callable[[], None] | None = None if self.dp is not None else after_noise

    def batches(self, dataset: Any, kind: str) -> Iterator[Batch]:
        """``steps`` Poisson batches (each example with probability ``batch_size / dataset_size``)."""
        if self.dp is not None:
            yield from self.dp.batches(dataset, kind, on_empty=self._empty)
            return
        if len(dataset) != self.dataset_size:
            raise ConfigError(f"dataset has {len(dataset)} examples, ClientPrivacy was built for {self.dataset_size}")
        for _ in range(self.steps):
            mask = torch.rand(self.dataset_size, generator=self.generator) < self.sample_rate
            index = mask.nonzero().flatten().numpy()
            if len(index) == 0:
                self._empty()
                continue
            yield collate(dataset[np.asarray(index)], kind)

    def _empty(self) -> None:
        if self.cut is not None:
            self.cut.account_empty_step()

    def metrics(self, prefix: str = "train-") -> dict[str, float]:
        """``train-epsilon`` (DP-SGD), ``train-cut-epsilon`` (activations), ``train-cut-grad-epsilon`` (labels)."""
        out: dict[str, float] = {}
        if self.dp is not None:
            out[f"{prefix}epsilon"] = self.dp.epsilon()
            out[f"{prefix}dp-noise-multiplier"] = self.dp.noise_multiplier
        if self.cut is not None:
            if self.cut.protects_inputs:
                out[f"{prefix}cut-epsilon"] = self.cut.epsilon()
            if self.cut.protects_labels:
                out[f"{prefix}cut-grad-epsilon"] = self.cut.gradient_epsilon()
        return out

    def expected_examples(self) -> int:
        """Expected examples over the round (report this as ``num-examples``: the actual count is data-dependent)."""
        return int(round(self.sample_rate * self.dataset_size * self.steps))

    def state_dict(self) -> dict[str, StateValue]:
        """All accountants' state, flat (``dp-*``, ``cut-*``, ``cut-grad-*``): store it as a Flower ConfigRecord."""
        out: dict[str, StateValue] = {}
        if self.dp is not None:
            out.update(self.dp.state_dict())
        if self.cut is not None:
            out.update(self.cut.state_dict())
        return out

    def close(self) -> None:
        """Remove every hook from the model."""
        if self.dp is not None:
            self.dp.close()
        if self.cut is not None:
            self.cut.remove()

    def __enter__(self) -> ClientPrivacy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def install_eval_noise(config: PrivacyConfig, model: torch.nn.Module) -> CutNoise | None:
    """For ``client_evaluate``: the activation noise the server would see (no accounting); remove() it after."""
    if not (config.cut_noise_clip > 0 and config.cut_noise_eval):
        return None
    return CutNoise(activation_clip=config.cut_noise_clip, activation_sigma=config.cut_noise_sigma).install(model)
