"""Trunk replicas over torch.distributed (gloo, CPU): a sync step over 2 replicas equals one trunk serving every
client (example-weighted, with unequal examples per replica); an idle replica still steps; async replicas are
averaged; a dead replica's clients move to rank 0."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from splitfed.channel.client.trunk import TrunkClient
from splitfed.channel.security.policy import ServerTransport
from splitfed.config import RunConfig
from splitfed.run.launcher import ReplicaSet, config_replica
from splitfed.split.base import CutState
from splitfed.trunk.timeline import TIMELINE, hops

HIDDEN = 256  # tiny-gpt2's width
LENGTHS = (5, 6, 7, 8)
# Examples per client, unequal between replicas (clients 0 and 2 go to rank 0, 1 and 3 to rank 1): the global step
# is the mean weighted by every client's examples, which a plain mean of the replicas' means is not.
EXAMPLES = (1, 6, 2, 9)


def _mapping(**overrides: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {"model": "tiny-gpt2", "trunk_replicas": 2, "lr": 0.05, "seed": 3, "auth": False,
                                "trunk_timeout": 30.0}
    settings.update(overrides)
    return RunConfig(**settings).to_mapping()  # type: ignore[arg-type]


def _servers(tmp_path: Path, mapping: dict[str, Any]) -> tuple[Any, ReplicaSet]:
    args = (mapping, "run", str(tmp_path), None, ServerTransport.from_settings("127.0.0.1"))
    server = config_replica(0, *args).start()
    return server, ReplicaSet(server, 2, config_replica, args, timeout_s=120.0).start()  # spawning is slow on a busy machine


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, ReplicaSet]]:
    """One sync replica set for the tests of this module (spawning a replica takes seconds): each test starts
    from the weights the previous one left, and the one that kills a replica comes last."""
    server, rs = _servers(tmp_path_factory.mktemp("replicas"), _mapping())
    try:
        yield server, rs
    finally:
        rs.stop()
        server.stop(grace=0)


def _inputs(client: int, step: int) -> tuple[CutState, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * client + step)
    n = LENGTHS[client]
    hidden = torch.randn(2, n, HIDDEN, generator=g)
    return CutState(hidden), torch.randn(2, n, HIDDEN, generator=g) * 0.1


def _steps(clients: dict[int, TrunkClient], steps: int) -> None:
    """Every client forwards, then all send their gradients at once (each backward waits for the sync step)."""
    for step in range(steps):
        acts = {}
        for i, tc in clients.items():
            state, _ = _inputs(i, step)
            acts[i] = f"a-{i}-{step}-{uuid.uuid4().hex[:8]}"
            tc.forward(state, activation_id=acts[i], train=True, num_examples=EXAMPLES[i])
        errors: list[BaseException] = []

        def back(i: int, act: str, grad: torch.Tensor, errors: list[BaseException] = errors) -> None:
            try:
                clients[i].backward(act, grad)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=back, args=(i, acts[i], _inputs(i, step)[1])) for i in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors


def _clients(addresses: dict[int, str]) -> dict[int, TrunkClient]:
    return {i: TrunkClient(a, insecure=True, client_id=f"client-{i}") for i, a in addresses.items()}


def _close(clients: dict[int, TrunkClient]) -> None:
    for tc in clients.values():
        tc.leave()  # out of the step group now, not after trunk-timeout
        tc.close()


def _reference(tmp_path: Path, start: dict[str, torch.Tensor], clients: tuple[int, ...],
               steps: int) -> dict[str, torch.Tensor]:
    """One trunk from weights ``start`` serving ``clients``: the weights after ``steps`` sync steps."""
    args = (_mapping(trunk_replicas=1), "run", str(tmp_path), None, ServerTransport.from_settings("127.0.0.1"))
    server = config_replica(0, *args)
    server.runtime.trunk.load_state_dict(start)  # plain SGD: the optimizer holds no state
    server.start()
    try:
        tcs = _clients({i: server.address for i in clients})
        _steps(tcs, steps)
        _close(tcs)
        assert server.runtime.version == steps
        return {k: v.clone() for k, v in server.runtime.trunk.state_dict().items()}
    finally:
        server.stop(grace=0)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_two_gloo_replicas_sync_equal_one_trunk(replicas: tuple[Any, ReplicaSet], tmp_path: Path) -> None:
    # Prepare: 4 clients, two on each replica (the ServerApp's assignment: least loaded first).
    server, rs = replicas
    start = {k: v.clone() for k, v in server.runtime.trunk.state_dict().items()}
    ranks = {i: rs.rank_for(100 + i) for i in range(4)}
    assert ranks == {0: 0, 1: 1, 2: 0, 3: 1}  # 3 examples a step on rank 0, 15 on rank 1
    tcs = _clients({i: rs.addresses[r] for i, r in ranks.items()})
    # Execute: 5 sync steps over the two replicas (rank 0's timeline recorded), then the same clients on one trunk.
    TIMELINE.start()
    try:
        _steps(tcs, 5)
    finally:
        recorded = TIMELINE.stop()
    _close(tcs)
    reference = _reference(tmp_path, start, tuple(range(4)), 5)
    # Assert: rank 1 equals rank 0 (the check runs after every step the loop took), which equals the single trunk.
    assert rs.group is not None and rs.group.divergence(timeout=30) <= 1e-6
    assert server.runtime.version == 5 and rs.group.stats["global-steps"] == 5
    assert _max_diff(server.runtime.trunk.state_dict(), reference) <= 1e-6
    assert _max_diff(start, reference) > 1e-4  # the trunk did train
    # Rank 0's control loop is on its timeline: each step it entered a tick with every gradient in, then stepped.
    figures = hops(recorded)
    assert figures["replica_ticks_per_step"] >= 1 and figures["replica_vetoes"] <= rs.group.stats["vetoed-steps"]
    assert 0 < figures["hop_replica_ready_wait_ms"] <= figures["hop_replica_ready_to_step_ms"]


def test_a_replica_without_clients_still_takes_every_step(replicas: tuple[Any, ReplicaSet], tmp_path: Path) -> None:
    # Prepare: one client, on replica 1; rank 0 has no member at all.
    server, rs = replicas
    start, version = {k: v.clone() for k, v in server.runtime.trunk.state_dict().items()}, server.runtime.version
    tcs = _clients({2: rs.addresses[1]})
    # Execute
    _steps(tcs, 3)
    _close(tcs)
    # Assert: rank 0 applied the same three updates (it joined every all-reduce with zeros).
    assert rs.group is not None and rs.group.divergence(timeout=30) <= 1e-6
    assert server.runtime.version == version + 3
    reference = _reference(tmp_path, start, (2,), 3)
    assert _max_diff(server.runtime.trunk.state_dict(), reference) <= 1e-6


def test_a_dead_replica_breaks_the_group_and_its_clients_move_to_rank_0(replicas: tuple[Any, ReplicaSet]) -> None:
    # Prepare: a node on each replica.
    server, rs = replicas
    assert rs.rank_for(1) == 0 and rs.rank_for(2) == 1
    # Execute: replica 1's process dies.
    rs._context.processes[0].kill()
    assert rs.group is not None
    rs.group.wait(30)
    # Assert: rank 0 serves alone, steps alone without waiting on a collective, and node 2 moves to it.
    assert not rs.group.active and rs.live() == [0]
    assert rs.rank_for(2) == 0 and rs.address_for(2) == rs.addresses[0]
    tcs = _clients({0: rs.addresses[0]})
    version, start = server.runtime.version, time.monotonic()
    _steps(tcs, 1)
    _close(tcs)
    assert server.runtime.version == version + 1 and time.monotonic() - start < 20
    rs.stop()  # the process group goes too, for the next test's replica set


def test_async_replicas_are_averaged_at_round_end(tmp_path: Path) -> None:
    # Prepare: async replicas; a client on each steps its replica on its own.
    server, rs = _servers(tmp_path, _mapping(trunk_mode="async"))
    try:
        tcs = _clients({0: rs.addresses[0], 1: rs.addresses[1]})
        for i, tc in tcs.items():
            state, grad = _inputs(i, 0)
            tc.forward(state, activation_id=f"x{i}", train=True, num_examples=2)
            tc.backward(f"x{i}", grad)
        _close(tcs)
        assert rs.group is not None
        assert rs.group.divergence(timeout=30) > 1e-5  # each replica took its own step
        # Execute
        rs.end_round()
        # Assert: identical weights, the version past both replicas' own.
        assert rs.group.divergence(timeout=30) == 0.0
        assert server.runtime.version == 2
    finally:
        rs.stop()
        server.stop(grace=0)
