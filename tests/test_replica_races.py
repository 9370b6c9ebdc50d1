"""A global sync step over trunk replicas waits for every client with a training forward outstanding on any replica,
whatever the timing: each test forces one interleaving (a replica serving before the group formed, a forward landing
between a tick's status and the step, a forward saved but not yet counted in the step group)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import splitfed.run.launcher as launcher
from splitfed.channel.client.trunk import BackwardReply, TrunkClient
from splitfed.channel.security.policy import ServerTransport
from splitfed.config import RunConfig
from splitfed.run.launcher import ReplicaSet, config_replica
from splitfed.split.base import CutState

HIDDEN = 256  # tiny-gpt2's width
EXAMPLES = {"early": 1, "late": 7, "other": 3}  # unequal: the step is the example-weighted mean


def _mapping(**overrides: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {"model": "tiny-gpt2", "trunk_replicas": 2, "lr": 0.05, "seed": 3, "auth": False,
                                "trunk_timeout": 60.0}
    settings.update(overrides)
    return RunConfig(**settings).to_mapping()  # type: ignore[arg-type]


def _args(tmp_path: Path, mapping: dict[str, Any]) -> tuple[Any, ...]:
    return (mapping, "run", str(tmp_path), None, ServerTransport.from_settings("127.0.0.1"))


def _inputs(name: str) -> tuple[CutState, torch.Tensor]:
    g = torch.Generator().manual_seed(len(name) * 7 + EXAMPLES[name])
    n = 4 + EXAMPLES[name] % 5
    return CutState(torch.randn(2, n, HIDDEN, generator=g)), torch.randn(2, n, HIDDEN, generator=g) * 0.1


def _forward(tc: TrunkClient, name: str) -> None:
    tc.forward(_inputs(name)[0], activation_id=f"act-{name}", train=True, num_examples=EXAMPLES[name])


class _Backward(threading.Thread):
    """A client's Backward in a thread of its own (it waits for the sync step)."""

    def __init__(self, tc: TrunkClient, name: str) -> None:
        super().__init__(daemon=True)
        self.tc, self.name = tc, name
        self.reply: BackwardReply | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.reply = self.tc.backward(f"act-{self.name}", _inputs(self.name)[1])
        except BaseException as exc:  # noqa: BLE001 - asserted by the test
            self.error = exc


def _until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _reference(tmp_path: Path, start: dict[str, torch.Tensor], names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """One trunk from ``start`` serving the clients ``names``: the weights after their one sync step."""
    server = config_replica(0, *_args(tmp_path, _mapping(trunk_replicas=1)))
    server.runtime.trunk.load_state_dict(start)  # plain SGD: the optimizer holds no state
    server.start()
    try:
        tcs = {name: TrunkClient(server.address, insecure=True, client_id=name) for name in names}
        for name, tc in tcs.items():
            _forward(tc, name)
        backs = [_Backward(tc, name) for name, tc in tcs.items()]
        for b in backs:
            b.join(60)
        assert all(b.reply is not None and b.reply.trunk_version == 1 for b in backs)
        return {k: v.clone() for k, v in server.runtime.trunk.state_dict().items()}
    finally:
        server.stop(grace=0)


def _assert_one_step_with_all(server: Any, rs: ReplicaSet, backs: list[_Backward], tmp_path: Path,
                              start: dict[str, torch.Tensor]) -> None:
    for b in backs:
        b.join(60)
        assert b.error is None and b.reply is not None, b.error
    # Every gradient went into the same step: version 1 for each, applied, fresh.
    assert [(b.reply.outcome, b.reply.trunk_version, b.reply.staleness) for b in backs] == [("APPLIED", 1, 0)] * len(backs)
    assert rs.group is not None and rs.group.stats["global-steps"] == 1
    assert rs.group.divergence(timeout=60) <= 1e-6
    reference = _reference(tmp_path, start, tuple(b.name for b in backs))
    diff = max(float((server.runtime.trunk.state_dict()[k] - reference[k]).abs().max()) for k in reference)
    assert diff <= 1e-6


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture
def started(tmp_path: Path) -> Iterator[tuple[Any, ReplicaSet]]:
    args = _args(tmp_path, _mapping())
    server = config_replica(0, *args).start()
    rs = ReplicaSet(server, 2, config_replica, args, timeout_s=120.0).start()
    try:
        yield server, rs
    finally:
        rs.stop()
        server.stop(grace=0)


def _state(server: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in server.runtime.trunk.state_dict().items()}


def test_replicas_serving_before_the_group_formed_do_not_step_alone(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: rank 0 serves at once, as `splitfed serve` does, and replica 1 as soon as it is spawned; rank 0 joins
    # the process group only when the test opens the gate (replica 1 waits for it there, serving).
    gate, join_group = threading.Event(), launcher._join_group

    def gated(*args: Any) -> Any:
        assert gate.wait(120)
        return join_group(*args)

    monkeypatch.setattr(launcher, "_join_group", gated)
    port = _free_port_pair()
    args = _args(tmp_path, _mapping(trunk_port=port))
    server = config_replica(0, *args).start()
    start = _state(server)
    rs, formed, done = ReplicaSet(server, 2, config_replica, args, timeout_s=120.0), threading.Event(), threading.Event()

    def form() -> None:  # the spawning thread lives as long as the replicas (they get SIGINT when it ends)
        rs.start()
        formed.set()
        done.wait(300)

    forming = threading.Thread(target=form, daemon=True)
    forming.start()
    try:
        early = TrunkClient(f"127.0.0.1:{port}", insecure=True, client_id="early")
        late = TrunkClient(f"127.0.0.1:{port + 1}", insecure=True, client_id="late")
        late.wait_ready(120)  # replica 1 serves; the group has not formed
        _forward(early, "early")
        _forward(late, "late")
        # Execute: rank 0's only member sends its gradient before the group exists.
        first = _Backward(early, "early")
        _until(lambda: server.runtime.aggregator.pending == 1 or not first.is_alive())
        # Assert: it waits (a step alone would leave out the client with a forward on replica 1).
        assert first.is_alive() and server.runtime.version == 0, first.reply
        gate.set()
        assert formed.wait(120) and rs.group is not None and rs.group.active
        _until(lambda: rs.group.stats["ticks"] >= 5 or server.runtime.version > 0)  # replica 1's: no gradient yet
        assert first.is_alive() and server.runtime.version == 0, first.reply
        second = _Backward(late, "late")
        _assert_one_step_with_all(server, rs, [first, second], tmp_path, start)
    finally:
        gate.set()
        formed.wait(120)
        rs.stop()
        done.set()
        server.stop(grace=0)


def test_a_forward_between_a_ticks_status_and_its_step_joins_the_step(started: tuple[Any, ReplicaSet],
                                                                      tmp_path: Path) -> None:
    # Prepare: a new client's training forward lands on rank 0 right after rank 0 reported itself ready for a step.
    server, rs = started
    start = _state(server)
    group = rs.group
    assert group is not None
    early = TrunkClient(rs.addresses[0], insecure=True, client_id="early")
    late = TrunkClient(rs.addresses[0], insecure=True, client_id="late")
    _forward(early, "early")
    status, injected = group._status, threading.Event()

    def status_then_forward() -> torch.Tensor:
        vec = status()
        if vec[2] and not injected.is_set():  # ready: the open bucket holds every member's gradient
            injected.set()
            _forward(late, "late")
        return vec

    group._status = status_then_forward  # type: ignore[method-assign]
    # Execute
    first = _Backward(early, "early")
    assert injected.wait(60)
    ticks = group.stats["ticks"]
    _until(lambda: group.stats["ticks"] >= ticks + 5 or server.runtime.version > 0)
    # Assert: the step waits for the newcomer, then takes both gradients.
    assert first.is_alive() and server.runtime.version == 0, first.reply
    second = _Backward(late, "late")
    _assert_one_step_with_all(server, rs, [first, second], tmp_path, start)


def test_a_forward_not_yet_counted_as_a_member_holds_the_step(started: tuple[Any, ReplicaSet],
                                                              tmp_path: Path) -> None:
    # Prepare: a member on each replica; rank 0's sends its gradient, replica 1's holds the step.
    server, rs = started
    start = _state(server)
    group = rs.group
    assert group is not None
    agg = server.runtime.aggregator
    early = TrunkClient(rs.addresses[0], insecure=True, client_id="early")
    other = TrunkClient(rs.addresses[1], insecure=True, client_id="other")
    late = TrunkClient(rs.addresses[0], insecure=True, client_id="late")
    _forward(early, "early")
    _forward(other, "other")
    first = _Backward(early, "early")
    _until(lambda: agg.pending == 1)
    # A newcomer's forward on rank 0 is computed and saved; the runtime has not yet put it in the step group.
    join, entered, release = agg.join, threading.Event(), threading.Event()

    def slow_join(client_id: str) -> int:
        if client_id == "late" and not entered.is_set():
            entered.set()
            assert release.wait(120)
        return join(client_id)

    agg.join = slow_join  # type: ignore[method-assign]
    pending_forward = threading.Thread(target=_forward, args=(late, "late"), daemon=True)
    pending_forward.start()
    try:
        assert entered.wait(60)
        # Execute: replica 1's member sends its gradient: no replica is still waiting for a member.
        third = _Backward(other, "other")
        _until(lambda: group.last_tick["busy"] == 0 or server.runtime.version > 0)
        ticks = group.stats["ticks"]  # a step decided at that tick is taken before the next one
        _until(lambda: group.stats["ticks"] >= ticks + 3 or server.runtime.version > 0)
        stepped_without_it = server.runtime.version > 0
    finally:
        release.set()
        pending_forward.join(60)
    # Assert: no step was taken without the newcomer; then one step takes all three gradients.
    assert not stepped_without_it and first.is_alive(), first.reply
    second = _Backward(late, "late")
    _assert_one_step_with_all(server, rs, [first, second, third], tmp_path, start)
