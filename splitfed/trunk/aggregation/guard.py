"""The gradient guard: trunk gradients that are non-finite or too large are refused, never applied."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from splitfed.trunk.aggregation.modes import Grads


@dataclass(frozen=True)
class GradientGuard:
    """Refuse trunk gradients that are non-finite or whose L2 norm exceeds ``max_norm`` (None: no bound)."""

    max_norm: float | None = None

    def check(self, grads: Grads) -> str | None:
        """Return why ``grads`` are refused, or None when they pass."""
        present = [g.detach() for g in grads if g is not None]
        if not present:
            return None
        norm = float(torch.nn.utils.get_total_norm(present, norm_type=2.0, error_if_nonfinite=False))
        if not math.isfinite(norm):
            return "non-finite trunk gradient"
        if self.max_norm is not None and norm > self.max_norm:
            return f"trunk gradient norm {norm:.3g} above the guard's {self.max_norm:.3g}"
        return None
