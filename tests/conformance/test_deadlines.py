"""Deadlines and cancellation over every transport: a call that passes its deadline fails DEADLINE_EXCEEDED on the
client, the server cancels it, and its work is not lost (a sync step still closes over its gradient, and the other
member gets its outcome, not an error); the server serves on."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from splitfed.channel.wire.retry import RetryPolicy
from splitfed.errors import ChannelError
from splitfed.split import CutState
from splitfed.trunk.aggregation.modes import make_aggregator

from .transports import Transport, hidden, trunk


def test_a_gradient_whose_call_passed_its_deadline_still_closes_the_step_of_the_others(transport: Transport) -> None:
    # Prepare: a sync trunk with members "a" and "b"; "a" gives up after 1 s.
    server = transport.open_server(trunk(), aggregator=make_aggregator("sync", timeout=120))
    gives_up = transport.open_client(server, client_id="a", retry=RetryPolicy(timeout_s=1.0))
    stays = transport.open_client(server, client_id="b")
    try:
        gives_up.join()
        stays.join()
        before = transport.went(server, gives_up)
        act = uuid.uuid4().hex
        out, _ = gives_up.forward(CutState(hidden().to(transport.device)), activation_id=act)
        # Execute: "a"'s gradient waits for "b" and its call passes its deadline.
        start = time.monotonic()
        with pytest.raises(ChannelError) as info:
            gives_up.backward(act, torch.ones_like(out, device=transport.device) * 0.01)
        assert info.value.code == "DEADLINE_EXCEEDED" and time.monotonic() - start < 10
        # Assert: the step closes over both gradients ("a"'s stayed in it), and "b" is told it applied.
        act_b = uuid.uuid4().hex
        out_b, _ = stays.forward(CutState(hidden().to(transport.device)), activation_id=act_b)
        reply = stays.backward(act_b, torch.ones_like(out_b, device=transport.device) * 0.01)
        assert reply.outcome == "APPLIED"
        stats = server.runtime.aggregator.stats
        assert stats["steps"] == 1 and stats["applied"] == 2 and server.runtime.version == 1
        assert transport.went(server, gives_up) == before + 1, f"the forward did not go over {transport.name}"
        assert transport.went(server, stays) >= 2
    finally:
        gives_up.close()
        stays.close()
        server.stop(grace=0)
