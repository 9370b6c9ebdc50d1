"""Privacy accounting: an opacus accountant whose state travels as plain lists (ready for a Flower ConfigRecord).

Every mechanism in :mod:`splitfed.privacy` is a Poisson-subsampled Gaussian
mechanism: per step, each example of the client's dataset is used with
probability ``sample_rate``, its contribution is clipped to a norm bound and
Gaussian noise of ``noise_multiplier`` times that bound is added. The
accountant composes these steps (across rounds too, when its state is kept)
and answers epsilon for a given delta.

The state is three parallel lists plus the mechanism's name, e.g.
``{"dp-accountant": "prv", "dp-noise-multipliers": [1.1], "dp-sample-rates":
[0.064], "dp-steps": [150]}``, so that it can be stored in Flower's
``context.state`` between rounds (clients may run in a fresh process each
round).
"""

from __future__ import annotations

import functools
import logging
import math
import warnings
from collections.abc import Mapping
from typing import Any

from splitfed.errors import ConfigError

log = logging.getLogger(__name__)

#: Accountants: ``prv`` (tight, numerical; opacus' default) and ``rdp`` (Renyi DP, an upper bound).
MECHANISMS = ("prv", "rdp")
#: Below this noise multiplier PRV needs huge grids (minutes, tens of GiB): RDP answers instead.
PRV_MIN_NOISE = 0.5

StateValue = str | list[float] | list[int]


def _epsilon(history: list[tuple[float, float, int]], delta: float, mechanism: str) -> float:
    """Epsilon of ``history`` (noise multiplier, sample rate, steps) at ``delta``."""
    from splitfed.extras import require

    create_accountant = require("opacus.accountants", "privacy accounting").create_accountant

    history = [(float(s), float(q), int(n)) for s, q, n in history if n > 0 and q > 0]
    if not history:
        return 0.0
    if any(s <= 0 for s, _, _ in history):
        return math.inf
    if mechanism == "prv" and min(s for s, _, _ in history) < PRV_MIN_NOISE:
        mechanism = "rdp"
    accountant = create_accountant(mechanism=mechanism)
    accountant.history = list(history)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return float(accountant.get_epsilon(delta=delta))
        except (ValueError, MemoryError, OverflowError, FloatingPointError) as exc:
            if mechanism == "rdp":
                raise
            log.warning("PRV accountant failed (%s); answering with the RDP bound", exc)
            return _epsilon(history, delta, "rdp")


@functools.lru_cache(maxsize=64)
def noise_for_epsilon(target_epsilon: float, delta: float, sample_rate: float, steps: int,
                      mechanism: str = "prv") -> float:
    """The noise multiplier that spends exactly ``target_epsilon`` over ``steps`` steps (opacus' search).

    Raises :class:`~splitfed.errors.ConfigError` when no finite noise reaches the target.
    """
    from splitfed.extras import require

    get_noise_multiplier = require("opacus.accountants.utils", "dp-target-epsilon").get_noise_multiplier

    if not target_epsilon > 0:
        raise ConfigError(f"dp-target-epsilon must be > 0, got {target_epsilon}")
    if not 0 < sample_rate <= 1:
        raise ConfigError(f"sample rate must be in (0, 1], got {sample_rate}; is batch-size larger than the shard?")
    if steps < 1:
        raise ConfigError(f"the planned number of steps must be >= 1, got {steps}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            sigma = float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta,
                                               sample_rate=sample_rate, steps=steps, accountant=mechanism))
        except ValueError as exc:
            raise ConfigError(f"dp-target-epsilon {target_epsilon} cannot be reached in {steps} steps at sample "
                              f"rate {sample_rate:.4g} ({exc}); raise the target, or train fewer steps") from None
    if mechanism == "prv" and sigma < PRV_MIN_NOISE:
        # The epsilon this accountant reports then comes from RDP: search with RDP so the two agree.
        return noise_for_epsilon(target_epsilon, delta, sample_rate, steps, "rdp")
    return sigma


class Accountant:
    """Composition of Poisson-subsampled Gaussian steps, with a serialisable state.

    Args:
        mechanism: ``prv`` or ``rdp``. PRV falls back to RDP for noise multipliers
            below :data:`PRV_MIN_NOISE`, where its numerical grid explodes.
        delta: the delta epsilon is reported at.
        prefix: prefix of the state's keys (``dp``, ``cut``, ``cut-grad``).
        state: a previous :meth:`state_dict` (e.g. from Flower's ``context.state``).
    """

    def __init__(self, mechanism: str = "prv", delta: float = 1e-5, prefix: str = "dp",
                 state: Mapping[str, Any] | None = None) -> None:
        if mechanism not in MECHANISMS:
            raise ConfigError(f"accountant must be one of {', '.join(MECHANISMS)}; got {mechanism!r}")
        if not 0 < delta < 1:
            raise ConfigError(f"delta must be in (0, 1), got {delta}")
        self.mechanism = mechanism
        self.delta = delta
        self.prefix = prefix
        self.history: list[tuple[float, float, int]] = []
        if state:
            self.load_state_dict(state)

    @property
    def steps(self) -> int:
        """Steps composed so far."""
        return sum(n for _, _, n in self.history)

    def step(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        """Compose ``steps`` more steps of one (noise multiplier, sample rate) pair."""
        if steps <= 0:
            return
        if self.history and self.history[-1][:2] == (float(noise_multiplier), float(sample_rate)):
            s, q, n = self.history[-1]
            self.history[-1] = (s, q, n + steps)
        else:
            self.history.append((float(noise_multiplier), float(sample_rate), int(steps)))

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far at ``delta`` (default: the accountant's); inf when a step had no noise."""
        return _epsilon(self.history, self.delta if delta is None else delta, self.mechanism)

    def projected(self, noise_multiplier: float, sample_rate: float, steps: int) -> float:
        """Epsilon after ``steps`` more steps (nothing is composed)."""
        return _epsilon(self.history + [(noise_multiplier, sample_rate, steps)], self.delta, self.mechanism)

    def state_dict(self) -> dict[str, StateValue]:
        """Plain strings and lists, e.g. ``{"dp-accountant": "prv", "dp-noise-multipliers": [...], ...}``."""
        p = self.prefix
        return {f"{p}-accountant": self.mechanism,
                f"{p}-noise-multipliers": [s for s, _, _ in self.history],
                f"{p}-sample-rates": [q for _, q, _ in self.history],
                f"{p}-steps": [n for _, _, n in self.history]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; keys of other prefixes are ignored, a missing prefix means empty."""
        p = self.prefix
        if f"{p}-steps" not in state:
            self.history = []
            return
        mechanism = str(state.get(f"{p}-accountant", self.mechanism))
        if mechanism != self.mechanism:
            raise ConfigError(f"the stored {p} accountant is {mechanism!r} but this run uses {self.mechanism!r}; "
                              "keep the accountant setting fixed for a run (or clear the client's state)")
        sigmas, rates, steps = (list(state[f"{p}-{k}"]) for k in ("noise-multipliers", "sample-rates", "steps"))
        if not len(sigmas) == len(rates) == len(steps):
            raise ConfigError(f"stored {p} accountant state has lists of different lengths "
                              f"({len(sigmas)}, {len(rates)}, {len(steps)}); clear the client's state")
        self.history = [(float(s), float(q), int(n)) for s, q, n in zip(sigmas, rates, steps)]
