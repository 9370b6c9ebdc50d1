"""Training through the router: four clients train against two sync trunk replicas behind one address and end with
the weights the same clients reach training against one trunk directly."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from splitfed.channel.client.remote import RemoteTrunk
from splitfed.channel.routing import Router
from splitfed.channel.security.policy import ServerTransport
from splitfed.config import RunConfig
from splitfed.data import Batch
from splitfed.run.launcher import ReplicaSet, config_replica
from splitfed.optim import make_optimizer
from splitfed.models.parts import CLIENT_ROLES, build_parts
from splitfed.split import SplitModel
from splitfed.client.training import train

CLIENTS, STEPS = 4, 4


def _mapping(replicas: int) -> dict[str, Any]:
    return RunConfig(model="mnist-cnn", trunk_replicas=replicas, lr=0.05, seed=3, auth=False,  # type: ignore[arg-type]
                     trunk_timeout=60.0).to_mapping()


def _data(client: int) -> list[Batch]:
    g = torch.Generator().manual_seed(100 + client)
    return [Batch(torch.randn(4, 1, 28, 28, generator=g), None, torch.randint(0, 10, (4,), generator=g))
            for _ in range(STEPS)]


def _train_clients(address: str, cfg: RunConfig) -> dict[int, dict[str, torch.Tensor]]:
    """Every client trains STEPS steps at once (each its own thread); returns each client's bottom and top."""
    states: dict[int, dict[str, torch.Tensor]] = {}
    errors: list[BaseException] = []

    splits = [build_parts(cfg, CLIENT_ROLES) for _ in range(CLIENTS)]  # seeded: built in turn, not in threads

    def client(i: int) -> None:
        try:
            split = splits[i]
            remote = RemoteTrunk(address, insecure=True, client_id=f"client-{i}", shared_memory="off")
            model = SplitModel(split.bottom, remote, split.top, task=split.task)
            optimizer = make_optimizer("sgd", split.client_modules().parameters(), cfg.lr)
            report = train(model, optimizer, _data(i), STEPS)
            assert report.steps == STEPS and remote.outcomes == {"APPLIED": STEPS}, remote.outcomes
            states[i] = {k: v.detach().clone() for k, v in split.client_modules().state_dict().items()}
            remote.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return states


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_clients_through_the_router_to_two_replicas_train_as_against_one_trunk(tmp_path: Path) -> None:
    # Prepare: two sync replicas (gloo) behind a router, and one trunk on its own, from the same seed
    transport = ServerTransport.from_settings("127.0.0.1")
    args = (_mapping(2), "run", str(tmp_path / "replicas"), None, transport)
    rank0 = config_replica(0, *args).start()
    replicas = ReplicaSet(rank0, 2, config_replica, args, timeout_s=60.0).start()
    router = Router(replicas.addresses, insecure=True, probe_interval_s=0.5).start()
    single = config_replica(0, _mapping(1), "run", str(tmp_path / "one"), None, transport).start()
    try:
        start = {k: v.clone() for k, v in rank0.runtime.trunk.state_dict().items()}
        assert _max_diff(start, single.runtime.trunk.state_dict()) == 0.0
        # Execute: the same clients, once through the router, once against the single trunk directly
        most = [0, 0]  # clients pinned to each replica at once, at most
        watching = threading.Event()

        def watch() -> None:
            while not watching.wait(0.02):
                most[:] = [max(m, s["pinned"]) for m, s in zip(most, router.stats())]
        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            routed = _train_clients(router.address, RunConfig.from_mapping(_mapping(2)))
        finally:
            watching.set()
            watcher.join()
        direct = _train_clients(single.address, RunConfig.from_mapping(_mapping(1)))
        # Assert: every step took all four clients on both sides; the trunks and every client's parts agree
        assert rank0.runtime.version == single.runtime.version == STEPS
        trunk_routed = rank0.runtime.trunk.state_dict()
        assert _max_diff(trunk_routed, single.runtime.trunk.state_dict()) <= 1e-6
        assert _max_diff(trunk_routed, start) > 1e-3  # it trained
        for i in range(CLIENTS):
            assert _max_diff(routed[i], direct[i]) <= 1e-6, i
        assert replicas.group is not None and replicas.group.divergence(timeout=30) <= 1e-6
        assert most == [2, 2]  # two clients on each replica
    finally:
        router.stop(grace=0)
        single.stop(grace=0)
        replicas.stop()
        rank0.stop(grace=0)
