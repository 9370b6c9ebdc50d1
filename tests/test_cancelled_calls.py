"""A call the client gives up on while its gradient waits for a sync step: a server stopped before that step leaves
none of the call's work pending. (That the step still closes for the other members, with their outcome, is the
conformance suite's deadline test, over every transport: tests/conformance/test_deadlines.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from conftest import tiny_model

from splitfed.channel.client.trunk import RetryPolicy, TrunkClient
from splitfed.errors import ChannelError
from splitfed.split import CutState, split_model
from splitfed.trunk.aggregation.modes import make_aggregator


@contextlib.contextmanager
def _a_gradient_given_up(trunk_server: Callable[..., Any]) -> Iterator[tuple[Any, TrunkClient]]:
    """A sync trunk with members "a" and "b"; "a"'s gradient waits for "b" and its call passes its deadline, so
    the server cancels the call while the gradient stays in the step. Yields the server and "b"."""
    split = split_model(tiny_model("llama", layers=2).train(), cuts=(1, 2))
    server = trunk_server(split.trunk, aggregator=make_aggregator("sync", timeout=120))
    gives_up = TrunkClient(server.address, insecure=True, client_id="a", retry=RetryPolicy(timeout_s=2.0))
    other = TrunkClient(server.address, insecure=True, client_id="b")
    try:
        gives_up.join()
        other.join()
        act = uuid.uuid4().hex
        out, _ = gives_up.forward(CutState(torch.randn(1, 3, 32)), activation_id=act, train=True)
        with pytest.raises(ChannelError, match="DEADLINE_EXCEEDED"):
            gives_up.backward(act, torch.ones_like(out) * 0.01)
        yield server, other
    finally:
        gives_up.close()
        other.close()


def test_a_server_stopped_while_a_cancelled_calls_work_waits_leaves_no_task_pending(trunk_server) -> None:
    """The work of a call the client gave up on runs on, detached, until its step; a server stopped before that
    step ("b" never sends) cancels it instead of leaving it to be destroyed pending with the loop ("Task was
    destroyed but it is pending!" at exit)."""
    with _a_gradient_given_up(trunk_server) as (server, _):
        loop = server._serving.loop
        assert any(not t.done() for t in asyncio.all_tasks(loop))  # the detached work, still waiting
        server.stop(grace=0)
        assert [t for t in asyncio.all_tasks(loop) if not t.done()] == []
