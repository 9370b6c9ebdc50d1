"""Retries of split-channel calls: gRPC's retry policy and retry budget, declared in the service config."""

from __future__ import annotations

import json
from dataclasses import dataclass

from splitfed.channel.limits import SERVICE_NAME


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

    def service_config(self) -> str:
        """The JSON service config gRPC reads (retry policy and retry budget)."""
        policy = {
            "maxAttempts": max(2, min(self.max_attempts, 5)),
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
