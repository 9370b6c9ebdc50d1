"""gRPC's retry budget (retryThrottling in the channel's service config): against a trunk that is down, retries
stop once the budget is spent, so many clients' calls do not multiply into a storm of attempts."""

from __future__ import annotations

import json
import threading
from concurrent import futures

import grpc
import pytest

from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.client.trunk import RetryPolicy

SERVICE = pb.DESCRIPTOR.services_by_name["SplitChannel"].full_name


class _Down(grpc.GenericRpcHandler):
    """Answers every call with UNAVAILABLE and counts the attempts."""

    def __init__(self) -> None:
        self.attempts = 0
        self._lock = threading.Lock()

    def service(self, handler_call_details):  # type: ignore[no-untyped-def]
        def abort(request, context):  # type: ignore[no-untyped-def]
            with self._lock:
                self.attempts += 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "trunk is down")

        return grpc.unary_unary_rpc_method_handler(abort)


def _attempts(policy: RetryPolicy, calls: int) -> int:
    down = _Down()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), handlers=[down])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.service_config", policy.service_config()),
                                                                  ("grpc.enable_retries", 1)]) as channel:
            call = channel.unary_unary(f"/{SERVICE}/Forward", request_serializer=None, response_deserializer=None)
            for _ in range(calls):
                with pytest.raises(grpc.RpcError) as info:
                    call(b"x", timeout=10)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)
    return down.attempts


def test_service_config_declares_the_retry_budget() -> None:
    config = json.loads(RetryPolicy(throttle_max_tokens=8, throttle_token_ratio=0.2).service_config())
    assert config["retryThrottling"] == {"maxTokens": 8, "tokenRatio": 0.2}
    assert "retryThrottling" not in json.loads(RetryPolicy(throttle_max_tokens=0).service_config())


def test_the_default_policy_makes_a_channel_that_works() -> None:
    """gRPC refuses a whole service config it cannot parse (e.g. a fractional maxTokens) at the first call."""
    # 10 tokens by default: the first call makes its 5 attempts (10 -> 5 tokens), later calls one each.
    assert _attempts(RetryPolicy(initial_backoff_s=0.01, max_backoff_s=0.02), 3) == 5 + 1 + 1


def test_retries_stop_once_the_budget_is_spent_against_a_trunk_that_is_down() -> None:
    fast = dict(max_attempts=5, initial_backoff_s=0.01, max_backoff_s=0.02)
    calls = 20
    # Without a budget every call makes all its attempts.
    assert _attempts(RetryPolicy(throttle_max_tokens=0, **fast), calls) == calls * 5
    # With 4 tokens: each failed attempt spends one and retries stop at half (2 tokens), so the first call
    # retries once and every later call makes its single attempt.
    assert _attempts(RetryPolicy(throttle_max_tokens=4, throttle_token_ratio=0.1, **fast), calls) == calls + 1
