"""Direct calls retry as gRPC calls do: a model reloaded while a client calls it over the engine's direct-call
socket answers UNAVAILABLE ("is being unloaded", "is loading") for a moment, and the client's calls retry under its
RetryPolicy (bounded attempts, backoff, one deadline, the retry budget) instead of failing."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from splitfed.channel.transports.shm import lane as shared
from splitfed.channel.admin.client import AdminClient
from splitfed.channel.client.trunk import TrunkClient
from splitfed.channel.wire.retry import RetryBudget, RetryPolicy, retrying
from splitfed.channel.server.trunkserver import TrunkServer
from splitfed.errors import ChannelError
from splitfed.serving.spec import ModelSpec
from splitfed.split import CutState

pytestmark = pytest.mark.usefixtures("one_thread")

TOKEN = "admin-" + "x" * 26
CNN_INPUT = (2, 32, 14, 14)  # mnist-cnn's input at cut 3


@pytest.fixture(autouse=True)
def small_tensors_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared, "MIN_REGION_TENSOR_BYTES", 1)  # the CNN's cut goes through the region, direct


def test_calls_over_the_direct_socket_survive_reloads(caplog: pytest.LogCaptureFixture) -> None:
    server = TrunkServer(models=[ModelSpec("mnist-cnn", name="cnn")], insecure=True, admin_token=TOKEN).start()
    errors: list[str] = []
    calls = [0, 0]  # forwards during the reloads, of them direct
    answered = threading.Semaphore(0)  # one release per forward answered
    reloading, done = threading.Event(), threading.Event()
    client = TrunkClient(server.address, insecure=True, model="cnn")

    def call_until_done() -> None:
        while not done.is_set():
            before = client.shared.direct_calls
            try:
                client.forward(CutState(torch.randn(*CNN_INPUT)), activation_id=uuid.uuid4().hex, train=False)
            except ChannelError as exc:
                errors.append(str(exc))
            else:
                answered.release()
            if reloading.is_set():
                calls[0] += 1
                calls[1] += client.shared.direct_calls - before

    try:
        client.forward(CutState(torch.randn(*CNN_INPUT)), train=False)
        assert client.shared.region.direct is not None  # the link is open: calls go over the direct socket
        caller = threading.Thread(target=call_until_done)
        caplog.set_level("INFO", logger="splitfed.channel.wire.retry")
        caller.start()
        with AdminClient(server.address, TOKEN, insecure=True) as admin:
            reloading.set()
            for _ in range(3):
                admin.reload("cnn")
                time.sleep(0.3)
                # The next reload once a forward got through this one: a call meets one reload at a time, whose
                # moment of UNAVAILABLE its retries outlast (three back to back can outlast any retry budget).
                while answered.acquire(blocking=False):
                    pass
                assert answered.acquire(timeout=30), "no forward got through the reload"
        done.set()
        caller.join(timeout=60)
        assert not caller.is_alive()
    finally:
        done.set()
        client.close()
        server.stop(grace=0)
    assert errors == []
    assert calls[1] > 0, calls  # calls went over the direct socket while the model reloaded ...
    retried = [r for r in caplog.records if "over the direct-call socket: UNAVAILABLE; retry" in r.getMessage()]
    assert retried, "no direct call met the reload: the test proves nothing"  # ... and some were retried


def test_retries_are_bounded_by_attempts_codes_and_budget() -> None:
    policy = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.02, throttle_max_tokens=0)
    seen: list[float | None] = []

    def unavailable(left: float | None) -> None:
        seen.append(left)
        raise ChannelError("model 'cnn' is loading", code="UNAVAILABLE")

    with pytest.raises(ChannelError):
        retrying(unavailable, policy, RetryBudget.of(policy), "Forward", timeout_s=30.0, sleep=lambda s: None)
    assert len(seen) == 4 and all(left is not None and 0 < left <= 30.0 for left in seen)

    seen.clear()

    def not_found(left: float | None) -> None:
        seen.append(left)
        raise ChannelError("no saved forward", code="NOT_FOUND")

    with pytest.raises(ChannelError):
        retrying(not_found, policy, RetryBudget.of(policy), "Backward", sleep=lambda s: None)
    assert len(seen) == 1  # not a retryable code

    budget = RetryBudget(max_tokens=4, token_ratio=1.0)  # retries stop at half the tokens: 2 failures allowed
    seen.clear()
    with pytest.raises(ChannelError):
        retrying(unavailable, policy, budget, "Forward", sleep=lambda s: None)
    assert len(seen) == 2
