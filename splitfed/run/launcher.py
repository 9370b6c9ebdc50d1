"""Starting trunk replicas: rank 0 in this process, ranks 1..N-1 spawned by ``torch.multiprocessing``.

:class:`ReplicaSet` takes this process's started
:class:`~splitfed.channel.server.trunkserver.TrunkServer` as rank 0, spawns the other
replicas with ``torch.multiprocessing.start_processes`` (the ``spawn`` start
method), and joins them all in the default ``torch.distributed`` process group
through a ``TCPStore`` that rank 0 hosts: NCCL when rank 0's trunk is on a GPU
(replica ``r`` on ``cuda:r``), else gloo. Each replica serves its own clients on
its own port and publishes its address in the store. The process group's
collectives are those of :mod:`splitfed.trunk.replicas.group`.

A replica process is built by a picklable ``build(rank, *build_args)`` that
returns its (not yet started) :class:`TrunkServer` with a runtime built as
rank 0's was (:func:`config_replica` for a SplitFed run, the CLI's and the
bench's own otherwise). The store, the process group and the processes are
torch's; only rank 0's own process can reach the store's port, which is bound
to loopback.

Clients are assigned to replicas by :meth:`ReplicaSet.address_for`: a node keeps
its replica while it lives, new nodes go to the least loaded live replica, and
the nodes of a replica that is gone are moved at their next message.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from splitfed.errors import ConfigError
from splitfed.trunk.replicas.group import ReplicaGroup, init_timeout, short_error

__all__ = ["ReplicaSet", "config_replica", "replica_device"]

log = logging.getLogger(__name__)

_ADDRESS = "splitfed/replica-address/{}"


def replica_device(rank: int, world_size: int, device: str | None = None) -> torch.device:
    """Where replica ``rank`` of ``world_size`` computes.

    ``device``: None picks ``cuda:rank`` when this machine has a GPU per replica, else the CPU; ``"cpu"`` puts
    every replica on the CPU; ``"cuda"`` puts replica r on ``cuda:r`` and needs a GPU per replica.

    Raises:
        ConfigError: ``"cuda"`` without a GPU per replica, or any other device (one GPU cannot hold the replicas:
            each takes a GPU of its own).
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device is None:
        return torch.device("cuda", rank) if gpus >= world_size else torch.device("cpu")
    if device == "cpu":
        return torch.device("cpu")
    if device == "cuda":
        if gpus < world_size:
            raise ConfigError(f"--device cuda with {world_size} replicas needs {world_size} GPUs (replica r on "
                              f"cuda:r); this machine has {gpus}: use --device cpu, or fewer --replicas")
        return torch.device("cuda", rank)
    raise ConfigError(f"with --replicas {world_size}, --device is cpu or cuda (replica r computes on cuda:r), not "
                      f"{device!r}; leave it out for a GPU per replica when there are enough, else the CPU")


def _exit_status(code: int) -> str:
    """``exit code 1``, or ``killed by SIGKILL`` for a process a signal ended."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _worker_broken(rank: int) -> Callable[[BaseException], None]:
    """What a spawned replica says when its group breaks: rank 0 reports the break, so one INFO line here."""
    def report(exc: BaseException) -> None:
        log.info("trunk replica %d: the replica group broke (%s); this replica stops", rank, short_error(exc))
    return report


def _join_group(store: Any, rank: int, world_size: int, backend: str, timeout_s: float) -> Any:
    """Join the default process group; returns the gloo group for control ticks (None: the default one)."""
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=init_timeout(timeout_s))
    return dist.new_group(backend="gloo", timeout=init_timeout(timeout_s)) if backend == "nccl" else None


def _worker(index: int, world_size: int, port: int, backend: str, timeout_s: float,
            build: Callable[..., Any], build_args: tuple[Any, ...]) -> None:
    """One spawned replica: build and start its server, publish its address, join the group, serve until the
    group ends."""
    rank = index + 1
    logging.basicConfig(level=os.environ.get("SPLITFED_REPLICA_LOG", "WARNING"),
                        format=f"%(asctime)s %(levelname)s replica-{rank} %(name)s: %(message)s")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    server = build(rank, *build_args).start()
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=init_timeout(timeout_s))
    store.set(_ADDRESS.format(rank), server.address)
    group: ReplicaGroup | None = None
    try:
        control = _join_group(store, rank, world_size, backend, timeout_s)
        group = ReplicaGroup(server.runtime, control=control, on_broken=_worker_broken(rank)).start()
        group.wait()
    finally:
        server.stop(grace=1.0)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # noqa: BLE001 - a broken group may not tear down cleanly; the process ends
                log.debug("replica %d: process group teardown: %s", rank, exc)


class ReplicaSet:
    """N trunk replicas: rank 0 (``server``, in this process) and N-1 spawned processes.

    Args:
        server: rank 0's started trunk server (its runtime's aggregator from
            :func:`~splitfed.trunk.replicas.group.replica_aggregator`).
        world_size: replicas in all (>= 2).
        build, build_args: ``build(rank, *build_args)`` makes replica ``rank``'s server (picklable: a
            module-level function).
        advertise: ``advertise(rank, bound_address)``: the address clients dial for a replica
            (default: the bound one).
        timeout_s: how long a collective waits for a hung replica, and how long the start may take.
    """

    def __init__(self, server: Any, world_size: int, build: Callable[..., Any], build_args: tuple[Any, ...] = (),
                 *, advertise: Callable[[int, str], str] | None = None, timeout_s: float = 300.0) -> None:
        if world_size < 2:
            raise ConfigError(f"trunk-replicas must be >= 2 for a replica set, got {world_size}")
        if dist.is_initialized():
            raise ConfigError("this process already belongs to a torch.distributed process group; run one replica "
                              "set per process")
        self.server = server
        self.world_size = world_size
        self.build, self.build_args = build, build_args
        self.advertise = advertise or (lambda rank, address: address)
        self.timeout_s = timeout_s
        self.backend = "nccl" if server.runtime.device.type == "cuda" else "gloo"
        self.addresses: list[str] = []
        self.group: ReplicaGroup | None = None
        self._context: Any = None
        self._assigned: dict[int, int] = {}

    def start(self) -> ReplicaSet:
        """Spawn the replicas, form the process group, broadcast rank 0's weights; returns self."""
        if self.backend == "nccl" and torch.cuda.device_count() < self.world_size:
            raise ConfigError(f"{self.world_size} trunk replicas on GPUs need {self.world_size} GPUs; this machine "
                              f"has {torch.cuda.device_count()}")
        store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True, wait_for_workers=False,
                              timeout=init_timeout(self.timeout_s))
        self._context = tmp.start_processes(_worker, args=(self.world_size, store.port, self.backend, self.timeout_s,
                                                           self.build, self.build_args),
                                            nprocs=self.world_size - 1, join=False, start_method="spawn")
        try:
            self._await_workers(store)
            control = _join_group(store, 0, self.world_size, self.backend, self.timeout_s)
            self.group = ReplicaGroup(self.server.runtime, control=control, on_broken=self._broken).start()
            bound = [self.server.address] + [store.get(_ADDRESS.format(r)).decode()
                                             for r in range(1, self.world_size)]
        except BaseException:
            self._kill()
            raise
        self.addresses = [self.advertise(rank, address) for rank, address in enumerate(bound)]
        log.info("%d trunk replicas (%s) serve at %s", self.world_size, self.backend, ", ".join(self.addresses))
        return self

    def _await_workers(self, store: Any) -> None:
        """Wait until every replica published its address; a replica that died on the way fails the start at once
        (its error in the message) instead of after the store's timeout."""
        keys = [_ADDRESS.format(r) for r in range(1, self.world_size)]
        deadline = time.monotonic() + self.timeout_s
        while not store.check(keys):
            try:
                self._context.join(timeout=0.2)
            except tmp.ProcessRaisedException as exc:
                raise ConfigError(f"a trunk replica failed to start: {exc}") from None
            except tmp.ProcessExitedException as exc:
                raise ConfigError(f"a trunk replica process ended while starting ({exc}); see its log above") from None
            if time.monotonic() > deadline:
                raise ConfigError(f"the trunk replicas did not start within {self.timeout_s:.0f}s")

    # -- clients ----------------------------------------------------------------------------------------
    def live(self) -> list[int]:
        """Ranks serving now: all while the group is whole, else rank 0 alone."""
        if self.group is not None and self.group.active and self._all_alive():
            return list(range(self.world_size))
        return [0]

    def _all_alive(self) -> bool:
        return self._context is not None and all(p.is_alive() for p in self._context.processes)

    def rank_for(self, node_id: int) -> int:
        """The replica of ``node_id``: its own while it lives, else the least loaded live one."""
        live = self.live()
        rank = self._assigned.get(node_id)
        if rank is None or rank not in live:
            load = Counter(r for r in self._assigned.values() if r in live)
            rank = min(live, key=lambda r: (load[r], r))
            if node_id in self._assigned:
                log.warning("node %s moves from trunk replica %d (gone) to replica %d", node_id,
                            self._assigned[node_id], rank)
            self._assigned[node_id] = rank
        return rank

    def address_for(self, node_id: int) -> str:
        """The address ``node_id`` dials (see :meth:`rank_for`)."""
        return self.addresses[self.rank_for(node_id)]

    # -- rounds and shutdown ----------------------------------------------------------------------------
    def end_round(self) -> None:
        """Average the replicas' weights (``async``/``quorum``) or check they agree (``sync``); rank 0 then
        holds what a checkpoint should save."""
        if self.group is not None and self.group.active:
            self.group.average(timeout=self.timeout_s)

    def gone(self, rank: int) -> bool:
        """Whether replica ``rank`` no longer serves: its process ended, or the group broke (then every replica
        but rank 0 is stopped). Rank 0, this process, is never gone."""
        if rank == 0 or self._context is None:
            return False
        broken = self.group is not None and not self.group.active
        return broken or not self._context.processes[rank - 1].is_alive()

    def _ended(self, wait_s: float = 2.0) -> dict[int, int]:
        """Replicas whose process ended, by rank: their exit codes. A killed peer's sockets close before its
        process can be reaped, so this waits up to ``wait_s`` for one to end."""
        deadline = time.monotonic() + wait_s
        while True:
            ended = {rank: p.exitcode for rank, p in enumerate(self._context.processes, start=1)
                     if not p.is_alive() and p.exitcode is not None}
            if ended or time.monotonic() >= deadline:
                return ended
            time.sleep(0.05)

    def _broken(self, exc: BaseException) -> None:
        """The group's control loop failed: one WARNING when a replica's process ended (an expected event: the
        collective's error is at DEBUG), the error and its traceback when every replica still runs."""
        ended = self._ended() if self._context is not None else {}
        if ended:
            log.warning("trunk replica %s ended (%s): the replica group is broken and rank 0 serves every client "
                        "from now on (restart to get the replicas back)", ", ".join(map(str, ended)),
                        ", ".join(_exit_status(code) for code in ended.values()))
        else:
            log.error("the trunk replica group broke while every replica still runs (a replica hung past the "
                      "group's timeout, or a collective failed); rank 0 serves every client from the next round",
                      exc_info=exc)
        self._kill()

    def _kill(self) -> None:
        if self._context is None:
            return
        for p in self._context.processes:
            if p.is_alive():
                p.terminate()
        for p in self._context.processes:
            p.join(10)
            if p.is_alive():
                p.kill()

    def stop(self) -> None:
        """End the group (every replica's server stops) and the spawned processes."""
        if self.group is not None:
            self.group.stop(timeout=min(self.timeout_s, 30.0))
        if self._context is not None:
            for p in self._context.processes:
                p.join(15)
        self._kill()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # noqa: BLE001 - a broken group may not tear down cleanly
                log.debug("process group teardown: %s", exc)


# -- a SplitFed run's replicas ----------------------------------------------------------------------------
def config_replica(rank: int, run_config: Mapping[str, Any], run_id: str, output_dir: str, secret: bytes | None,
                   transport: Any) -> Any:
    """Replica ``rank`` of a SplitFed run's trunk: built from the run config exactly as rank 0's, with its
    optimizer state from the checkpoint when resuming (rank 0's weights are broadcast at start)."""
    from splitfed.channel.security.tokens import TokenIssuer
    from splitfed.channel.server.trunkserver import TrunkServer
    from splitfed.run.checkpoint import read_checkpoint, unflatten
    from splitfed.config import RunConfig
    from splitfed.logs import setup_logging
    from splitfed.models.parts import build_parts, is_pretrained, model_cuts

    cfg = RunConfig.from_mapping(run_config)
    if rank:  # a spawned replica's own process: log as the ServerApp does
        setup_logging(cfg.log_level, json_lines=cfg.log_json, run_id=run_id, replica=rank)
    split = build_parts(cfg, ("trunk",) if is_pretrained(cfg) else ("bottom", "trunk", "top"))
    runtime = runner_runtime(cfg, split.trunk.to(replica_device(rank, cfg.trunk_replicas)))
    if cfg.resume and (Path(output_dir) / "checkpoint").exists():
        saved = read_checkpoint(output_dir)
        runtime.load_state_dict({"trunk": saved.tensors["trunk"], "version": saved.meta["trunk-version"],
                                 "optimizer": unflatten(saved.meta["optimizer"], saved.tensors.get("optimizer", {}))},
                                strict=not cfg.lora_rank)
    tokens = TokenIssuer(run_id, secret=secret, ttl_s=cfg.token_ttl) if secret is not None else None
    return TrunkServer(runtime, host=cfg.trunk_bind, port=cfg.trunk_port + rank if cfg.trunk_port else 0,
                       insecure=transport.insecure, credentials=transport.credentials(), model_name=cfg.model,
                       cuts=model_cuts(cfg), authenticate=None if tokens is None else tokens.authenticate,
                       batch_window_ms=cfg.trunk_batch_window_ms, max_batch_tokens=cfg.trunk_max_batch_tokens,
                       max_concurrent_rpcs=cfg.trunk_max_concurrent_rpcs,
                       shared_memory_bytes=cfg.trunk_shared_memory_mib << 20,
                       bulk_connections=cfg.bulk_connections,
                       bulk_tls=transport.bulk_context() if cfg.bulk_connections else None, bulk_port=cfg.bulk_port)


def runner_runtime(cfg: Any, trunk: torch.nn.Module, aggregator: Any = None) -> Any:
    """A SplitFed run's trunk runtime over ``trunk`` (optimizer, aggregator, guard, precision from ``cfg``;
    ``aggregator``: one of your own instead of the one ``trunk-mode`` names)."""
    from splitfed.optim import make_optimizer
    from splitfed.trunk.aggregation.modes import make_aggregator
    from splitfed.trunk.replicas.group import replica_aggregator
    from splitfed.trunk.compute.runtime import GradientGuard, TrunkRuntime

    trainable = [p for p in trunk.parameters() if p.requires_grad]
    optimizer = make_optimizer(cfg.optimizer, trainable, cfg.effective_trunk_lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay) if trainable else None
    if aggregator is None and cfg.trunk_replicas > 1:
        aggregator = replica_aggregator(cfg.trunk_mode, quorum=cfg.quorum, max_staleness=cfg.max_staleness,
                                        staleness_policy=cfg.staleness_policy, timeout=cfg.trunk_timeout)
    elif aggregator is None:  # per-client copies get the trunk's optimizer settings, and FedProx's term
        proximal = cfg.proximal_mu if (cfg.trunk_strategy or cfg.strategy) == "fedprox" else 0.0
        aggregator = make_aggregator(
            cfg.trunk_mode, quorum=cfg.quorum, max_staleness=cfg.max_staleness, staleness_policy=cfg.staleness_policy,
            timeout=cfg.trunk_timeout, seed=cfg.seed, proximal_mu=proximal,
            copy_optimizer=lambda ps: make_optimizer(cfg.optimizer, ps, cfg.effective_trunk_lr, momentum=cfg.momentum,
                                                     weight_decay=cfg.weight_decay))
    return TrunkRuntime(trunk, optimizer, aggregator=aggregator, guard=GradientGuard(cfg.grad_guard_norm or None),
                        autocast_dtype=torch.bfloat16 if cfg.precision == "bf16" else None,
                        checkpointing=cfg.trunk_checkpointing)


def advertised(advertise: str, rank: int, address: str) -> str:
    """Replica ``rank``'s address for clients: ``trunk-advertise`` host:port shifted by ``rank``, a wildcard
    bind as loopback, else the bound address."""
    if advertise:
        host, _, port = advertise.rpartition(":")
        return f"{host}:{int(port) + rank}"
    host, _, port = address.rpartition(":")
    if host in ("0.0.0.0", "[::]", "::"):
        return f"127.0.0.1:{port}"
    return address
