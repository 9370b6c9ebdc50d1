"""Noise at the cut: clip each example's activation (or gradient) to a norm and add Gaussian noise.

Two knobs on the client, one pure function for the server:

* **activation noise** (``activation_clip``/``activation_sigma``): a forward hook
  on the bottom part replaces each example's cut activation ``h`` by
  ``h * min(1, C / ||h||) + N(0, (sigma C)^2 I)`` before it leaves the client.
  It limits what the trunk server learns about the client's *inputs*.
* **gradient noise** (``gradient_clip``/``gradient_sigma``): in the U-shaped
  split the client computes the loss, so the gradient it sends back for the
  trunk's output carries the *labels* (Li et al., "Label Leakage and Protection
  in Two-party Split Learning"). A forward pre-hook on the top part makes that
  gradient pass through the same clip-and-noise, per example, before it leaves.
* :func:`clip_and_noise` is the pure function behind both; a trunk runtime can
  call it on the gradient it returns to clients (that hides details of the
  trunk from clients, not the clients' data from the server).

Accounting: each training forward (resp. backward) is a Poisson-subsampled
Gaussian mechanism with noise multiplier ``sigma`` on a row of L2 sensitivity
``C``; :class:`~splitfed.privacy.accounting.Accountant` composes them.
See ``docs/privacy.md`` for what this guarantee assumes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from splitfed.errors import ConfigError
from splitfed.privacy.accounting import Accountant, StateValue
from splitfed.split.base import CutState

log = logging.getLogger(__name__)


def clip_and_noise(x: torch.Tensor, clip: float, sigma: float, *, scale: float = 1.0,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip every row (example) of ``x`` to L2 norm ``clip`` and add ``N(0, (sigma * clip)^2)`` noise.

    ``scale`` multiplies ``x`` before and divides it after, so that a gradient of a
    batch-mean loss (each row scaled by ``1 / batch``) is clipped as the gradient of
    its example's own loss: pass ``scale=batch_size`` for such gradients.

    Returns ``(noised, norms)`` where ``norms`` are the rows' norms before clipping
    (after scaling). Pure: differentiable in ``x`` (through the clip factor too), does
    not modify ``x``.
    """
    if clip <= 0:
        raise ConfigError(f"the clip norm must be > 0, got {clip}")
    if sigma < 0:
        raise ConfigError(f"the noise multiplier sigma must be >= 0, got {sigma}")
    if x.shape[0] == 0:
        return x, x.new_zeros(0)
    y = x.float() * scale
    norms = y.flatten(1).norm(dim=1)
    factor = (clip / (norms + 1e-12)).clamp(max=1.0)  # differentiable: the bottom learns what is really sent
    y = y * factor.view(-1, *([1] * (y.dim() - 1)))
    norms = norms.detach()
    if sigma > 0:
        noise = torch.randn(y.shape, generator=generator, device=y.device, dtype=y.dtype)
        y = y + noise * (sigma * clip)
    return (y / scale).to(x.dtype), norms


class _NoisyGradient(torch.autograd.Function):
    """Identity forward; backward clips and noises each example's gradient (of its own loss)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, noise: CutNoise) -> torch.Tensor:
        ctx.noise = noise
        return hidden.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        noise: CutNoise = ctx.noise
        out, norms = clip_and_noise(grad, noise.gradient_clip, noise.gradient_sigma,
                                    scale=float(grad.shape[0]) if noise.mean_loss else 1.0,
                                    generator=noise.generator)
        noise.stats.gradient_norms = norms
        noise._account("gradient")
        return out, None


@dataclass
class CutStats:
    """What the last training step clipped: per-example norms before clipping."""

    activation_norms: torch.Tensor | None = None
    gradient_norms: torch.Tensor | None = None
    forwards: int = 0
    backwards: int = 0


class CutNoise:
    """Clip-and-noise of what crosses the cut, as hooks on a :class:`~splitfed.split.SplitModel`.

    Args:
        activation_clip, activation_sigma: clip norm ``C`` and noise multiplier of the
            bottom's output (0 clip: off). Noise std is ``sigma * C``.
        gradient_clip, gradient_sigma: the same for the gradient the client sends back
            for the trunk's output (labels); applied in training only.
        sample_rate: Poisson sampling rate of the batches (for the accountants).
        delta, accountant: reported delta and accountant (``prv`` or ``rdp``).
        state: a previous :meth:`state_dict` (accounting across rounds).
        in_eval: also noise activations in evaluation (the server sees those too).
        mean_loss: gradients are of a batch-mean loss (clip them per example's own loss).
        generator: random source for the noise (default: torch's global one).
    """

    def __init__(self, *, activation_clip: float = 0.0, activation_sigma: float = 0.0, gradient_clip: float = 0.0,
                 gradient_sigma: float = 0.0, sample_rate: float | None = None, delta: float = 1e-5,
                 accountant: str = "prv", state: Mapping[str, Any] | None = None, in_eval: bool = True,
                 mean_loss: bool = True, generator: torch.Generator | None = None) -> None:
        for key, value in [("cut-noise-clip", activation_clip), ("cut-noise-sigma", activation_sigma),
                           ("cut-grad-clip", gradient_clip), ("cut-grad-sigma", gradient_sigma)]:
            if value < 0:
                raise ConfigError(f"{key} must be >= 0, got {value}")
        if activation_sigma > 0 and activation_clip <= 0:
            raise ConfigError("cut-noise-sigma needs cut-noise-clip > 0 (noise is scaled by the clip norm)")
        if gradient_sigma > 0 and gradient_clip <= 0:
            raise ConfigError("cut-grad-sigma needs cut-grad-clip > 0 (noise is scaled by the clip norm)")
        if sample_rate is not None and not 0 < sample_rate <= 1:
            raise ConfigError(f"sample rate must be in (0, 1], got {sample_rate}")
        self.activation_clip, self.activation_sigma = float(activation_clip), float(activation_sigma)
        self.gradient_clip, self.gradient_sigma = float(gradient_clip), float(gradient_sigma)
        self.sample_rate = sample_rate
        self.in_eval = in_eval
        self.mean_loss = mean_loss
        self.generator = generator
        self.activation_accountant = Accountant(accountant, delta, prefix="cut", state=state)
        self.gradient_accountant = Accountant(accountant, delta, prefix="cut-grad", state=state)
        self.stats = CutStats()
        self._handles: list[Any] = []

    @property
    def protects_inputs(self) -> bool:
        """Whether activations are clipped (and noised)."""
        return self.activation_clip > 0

    @property
    def protects_labels(self) -> bool:
        """Whether the gradients sent to the server are clipped (and noised)."""
        return self.gradient_clip > 0

    # -- hooks -------------------------------------------------------------------------
    def install(self, model: nn.Module) -> CutNoise:
        """Hook into ``model.bottom`` (activations) and ``model.top`` (gradients); returns self."""
        if self._handles:
            raise ConfigError("this CutNoise is already installed; call remove() first")
        if self.protects_inputs:
            self._handles.append(model.bottom.register_forward_hook(self._noise_activation))
        if self.protects_labels:
            self._handles.append(model.top.register_forward_pre_hook(self._noise_gradient, with_kwargs=True))
        return self

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _training(self, module: nn.Module) -> bool:
        return module.training and torch.is_grad_enabled()

    def _noise_activation(self, module: nn.Module, args: Any, output: Any) -> Any:
        training = self._training(module)
        if not training and not self.in_eval:
            return output
        hidden = output.hidden if isinstance(output, CutState) else output
        noised, norms = clip_and_noise(hidden, self.activation_clip, self.activation_sigma, generator=self.generator)
        if training:
            self.stats.activation_norms = norms
            self._account("activation")
        return output.with_hidden(noised) if isinstance(output, CutState) else noised

    def _noise_gradient(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._training(module) or not args:
            return None
        state = args[0]
        hidden = state.hidden if isinstance(state, CutState) else state
        if not hidden.requires_grad:
            return None
        hidden = _NoisyGradient.apply(hidden, self)
        new = state.with_hidden(hidden) if isinstance(state, CutState) else hidden
        return (new, *args[1:]), kwargs

    def _account(self, kind: str) -> None:
        if kind == "activation":
            self.stats.forwards += 1
            if self.sample_rate is not None:
                self.activation_accountant.step(self.activation_sigma, self.sample_rate)
        else:
            self.stats.backwards += 1
            if self.sample_rate is not None:
                self.gradient_accountant.step(self.gradient_sigma, self.sample_rate)

    def account_empty_step(self) -> None:
        """Count a sampling step whose batch came out empty (nothing crossed the cut)."""
        if self.sample_rate is None:
            return
        if self.protects_inputs:
            self.activation_accountant.step(self.activation_sigma, self.sample_rate)
        if self.protects_labels:
            self.gradient_accountant.step(self.gradient_sigma, self.sample_rate)

    # -- accounting ----------------------------------------------------------------------
    def epsilon(self) -> float:
        """Epsilon of the activations sent so far (inputs vs. the server); 0 when off."""
        return self.activation_accountant.epsilon() if self.protects_inputs else 0.0

    def gradient_epsilon(self) -> float:
        """Epsilon of the gradients sent so far (labels vs. the server); 0 when off."""
        return self.gradient_accountant.epsilon() if self.protects_labels else 0.0

    def per_release_epsilon(self, kind: str = "activation") -> float:
        """Epsilon of ONE release of one example's row (sample rate 1, one step): the worst case per exposure."""
        sigma = self.activation_sigma if kind == "activation" else self.gradient_sigma
        return Accountant(self.activation_accountant.mechanism, self.activation_accountant.delta).projected(
            sigma, 1.0, 1)

    def state_dict(self) -> dict[str, StateValue]:
        """Both accountants' states (keys ``cut-*`` and ``cut-grad-*``)."""
        return {**self.activation_accountant.state_dict(), **self.gradient_accountant.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore both accountants."""
        self.activation_accountant.load_state_dict(state)
        self.gradient_accountant.load_state_dict(state)
