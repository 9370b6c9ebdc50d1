"""A call the client gives up on (or whose client dies) while its gradient waits for a sync step: the step still
closes for the other members, and they get their outcome, not an internal error."""

from __future__ import annotations

import uuid

import pytest
import torch
from conftest import tiny_model

from splitfed.channel.client import RetryPolicy, TrunkClient
from splitfed.errors import ChannelError
from splitfed.split import CutState, split_model
from splitfed.trunk.aggregation import make_aggregator


def test_a_gradient_whose_call_was_cancelled_does_not_fail_the_step_of_the_others(trunk_server) -> None:
    split = split_model(tiny_model("llama", layers=2).train(), cuts=(1, 2))
    server = trunk_server(split.trunk, aggregator=make_aggregator("sync", timeout=120))
    gives_up = TrunkClient(server.address, insecure=True, client_id="a", retry=RetryPolicy(timeout_s=3.0))
    stays = TrunkClient(server.address, insecure=True, client_id="b")
    try:
        gives_up.join()
        stays.join()
        # Execute: "a"'s gradient waits for "b"; "a"'s call passes its deadline, so the server cancels it.
        act = uuid.uuid4().hex
        out, _ = gives_up.forward(CutState(torch.randn(1, 3, 32)), activation_id=act, train=True)
        with pytest.raises(ChannelError, match="DEADLINE_EXCEEDED"):
            gives_up.backward(act, torch.ones_like(out) * 0.01)
        act = uuid.uuid4().hex
        out, _ = stays.forward(CutState(torch.randn(1, 3, 32)), activation_id=act, train=True)
        reply = stays.backward(act, torch.ones_like(out) * 0.01)
        # Assert: the step closed over both gradients ("a"'s was in the bucket) and "b" was told so.
        assert reply.outcome == "APPLIED"
        assert server.runtime.aggregator.stats["steps"] == 1 and server.runtime.aggregator.stats["applied"] == 2
    finally:
        gives_up.close()
        stays.close()


def test_a_server_stopped_while_a_cancelled_calls_work_waits_leaves_no_task_pending(trunk_server) -> None:
    """The work of a call the client gave up on runs on, detached, until its step; a server stopped before that
    step cancels it instead of leaving it to be destroyed pending with the loop ("Task was destroyed but it is
    pending!" at exit)."""
    import asyncio

    split = split_model(tiny_model("llama", layers=2).train(), cuts=(1, 2))
    server = trunk_server(split.trunk, aggregator=make_aggregator("sync", timeout=120))
    gives_up = TrunkClient(server.address, insecure=True, client_id="a", retry=RetryPolicy(timeout_s=2.0))
    never = TrunkClient(server.address, insecure=True, client_id="b")
    try:
        gives_up.join()
        never.join()  # a member that never sends: "a"'s gradient waits for the step
        act = uuid.uuid4().hex
        out, _ = gives_up.forward(CutState(torch.randn(1, 3, 32)), activation_id=act, train=True)
        with pytest.raises(ChannelError, match="DEADLINE_EXCEEDED"):
            gives_up.backward(act, torch.ones_like(out) * 0.01)
        loop = server._loop
        assert any(not t.done() for t in asyncio.all_tasks(loop))  # the detached work, still waiting
        server.stop(grace=0)
        assert [t for t in asyncio.all_tasks(loop) if not t.done()] == []
    finally:
        gives_up.close()
        never.close()
