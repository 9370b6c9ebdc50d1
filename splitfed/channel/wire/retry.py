"""Retries of split-channel calls: gRPC's retry policy and retry budget, declared in the service config.

Calls that do not go through gRPC (direct calls over the engine's Unix socket, :mod:`splitfed.channel.transports.direct.client`)
retry under the same policy and budget with :func:`retrying`, which does what gRPC does with the service config:
at most :attr:`RetryPolicy.attempts` attempts, a jittered, capped exponential backoff between them, only for the
retryable codes, all within the call's one deadline, and no retry while the budget is spent.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from splitfed.errors import ChannelError

from splitfed.channel.wire.limits import SERVICE_NAME

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """gRPC retry policy for transient failures, declared in the channel's service config.

    Retries use capped exponential backoff and apply to UNAVAILABLE (and the
    other codes listed). ``timeout_s`` bounds each call as a whole, retries
    included: past it the call fails with DEADLINE_EXCEEDED and the client
    raises :class:`~splitfed.errors.ChannelError`.
    """

    max_attempts: int = 5
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    backoff_multiplier: float = 2.0
    retryable_codes: tuple[str, ...] = ("UNAVAILABLE",)
    timeout_s: float = 300.0
    # gRPC's retry budget (retryThrottling), one per channel: each failed attempt spends a token, each
    # success earns ``throttle_token_ratio``; at half of ``throttle_max_tokens`` or below no call is retried.
    # With the defaults, against a trunk that is down a channel's first call makes its 5 attempts (4 retries)
    # and its later calls one attempt each, not 5 per call, while a trunk that loses one reply in two is still
    # retried. 0 turns the budget off.
    throttle_max_tokens: int = 10
    throttle_token_ratio: float = 1.0

    @property
    def attempts(self) -> int:
        """Attempts per call, first included, as gRPC counts them (it caps ``maxAttempts`` at 5, and 1 means no
        retry policy at all, so at least 2)."""
        return max(2, min(self.max_attempts, 5))

    def backoff_s(self, retry: int) -> float:
        """Seconds before retry number ``retry`` (1 for the first): gRPC's jittered backoff, uniform in
        ``[0, min(initial * multiplier ** (retry - 1), max)]``."""
        ceiling = min(self.initial_backoff_s * self.backoff_multiplier ** (retry - 1), self.max_backoff_s)
        return random.uniform(0.0, max(0.0, ceiling))

    def service_config(self) -> str:
        """The JSON service config gRPC reads (retry policy and retry budget)."""
        policy = {
            "maxAttempts": self.attempts,
            "initialBackoff": f"{self.initial_backoff_s}s",
            "maxBackoff": f"{self.max_backoff_s}s",
            "backoffMultiplier": self.backoff_multiplier,
            "retryableStatusCodes": list(self.retryable_codes),
        }
        config: dict[str, object] = {"methodConfig": [{"name": [{"service": SERVICE_NAME}], "retryPolicy": policy}]}
        if self.throttle_max_tokens > 0:
            config["retryThrottling"] = {"maxTokens": int(self.throttle_max_tokens),  # gRPC wants an integer
                                         "tokenRatio": self.throttle_token_ratio}
        return json.dumps(config)


class RetryBudget:
    """gRPC's retry throttling (``retryThrottling``) for calls that do not go through gRPC: ``max_tokens`` tokens;
    a failure with a retryable code spends one, a success earns ``token_ratio``; at half of ``max_tokens`` or below
    no call is retried. ``max_tokens`` 0: no budget (every retry allowed). Thread-safe."""

    def __init__(self, max_tokens: int, token_ratio: float) -> None:
        self.max_tokens = float(max_tokens)
        self.token_ratio = float(token_ratio)
        self.tokens = float(max_tokens)
        self._lock = threading.Lock()

    @classmethod
    def of(cls, policy: RetryPolicy) -> RetryBudget:
        """The budget ``policy`` declares."""
        return cls(policy.throttle_max_tokens, policy.throttle_token_ratio)

    def failed(self) -> bool:
        """Spend a token for a retryable failure; whether a retry is still allowed."""
        with self._lock:
            self.tokens = max(0.0, self.tokens - 1.0)
            return self.max_tokens <= 0 or self.tokens > self.max_tokens / 2

    def succeeded(self) -> None:
        """Earn ``token_ratio`` for a call that succeeded."""
        with self._lock:
            self.tokens = min(self.max_tokens, self.tokens + self.token_ratio)


def retrying(attempt: Callable[[float | None], T], policy: RetryPolicy, budget: RetryBudget, what: str,
             timeout_s: float | None = None, sleep: Callable[[float], None] = time.sleep) -> T:
    """``attempt(seconds left)`` until it returns, retried as gRPC retries a call under ``policy``: a
    :class:`~splitfed.errors.ChannelError` whose code is retryable is retried after :meth:`RetryPolicy.backoff_s`
    while attempts, the deadline (``timeout_s`` for the whole call, retries included; None: none) and ``budget``
    allow, and the last error is raised otherwise. Any other exception ends the call at once."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    number = 0
    while True:
        number += 1
        try:
            result = attempt(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except ChannelError as exc:
            if exc.code not in policy.retryable_codes:
                raise
            allowed = budget.failed()
            pause = policy.backoff_s(number)
            if number >= policy.attempts or not allowed or (deadline is not None
                                                             and time.monotonic() + pause >= deadline):
                raise
            log.info("%s: %s; retry %d of %d in %.2f s", what, exc.code, number, policy.attempts - 1, pause)
            sleep(pause)
            continue
        budget.succeeded()
        return result
