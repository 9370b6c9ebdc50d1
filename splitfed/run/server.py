"""The server side of a SplitFed run, independent of Flower.

:class:`ServerRunner` builds the model, keeps the trunk in a running
:class:`~splitfed.channel.server.trunkserver.TrunkServer`, issues per-client tokens,
checkpoints every round and exports the trained model.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from splitfed.config import RunConfig
from splitfed.run.checkpoint import CURRENT, STATE, Checkpoint, flatten, read_checkpoint, unflatten, write_checkpoint
from splitfed.run.messages import SERVER_ROUND, TRUNK_ADDRESS, TRUNK_CA, TRUNK_TOKEN
from splitfed.models.parts import (
    ALL_ROLES,
    build_parts,
    full_split_for_export,
    initial_client_state,
    is_pretrained,
    load_client_state,
    model_cuts,
    trainable_state,
)
from splitfed.run.provenance import META_KEY, RunIdentity
from splitfed.run.tensorboard import RoundWriter
from splitfed.trunk.aggregation.modes import TrunkAggregator
from splitfed.workload import tokenizer_for

log = logging.getLogger(__name__)


@dataclass
class RoundRecord:
    """One round in the history."""

    round: int
    train: dict[str, float] = field(default_factory=dict)
    evaluate: dict[str, float] = field(default_factory=dict)
    trunk: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    #: Clients that failed: ``train`` / ``train-sent``, ``evaluate`` / ``evaluate-sent``, ``first-error``.
    failures: dict[str, Any] = field(default_factory=dict)
    #: The ServerApp's own evaluation of the round's model (``evaluate_fn`` of ``Strategy.start``).
    central: dict[str, float] = field(default_factory=dict)


class ServerRunner:
    """The server side of a run: trunk server, tokens, checkpoints, history and export.

    Args:
        cfg: the run's settings.
        run_id: Flower's run id (tokens of other runs are refused).
        output_dir: where checkpoints, the history and the exported model go.
        aggregator: the trunk's aggregator (default: the one ``trunk-mode`` names; see ``docs/research.md``).
        app, strategy_class: the Flower app (FAB id) and the class of the strategy that aggregates the client
            parts, recorded in every checkpoint with the run's settings: ``resume = true`` continues only the run
            that made a checkpoint (:mod:`splitfed.run.provenance`).
    """

    def __init__(self, cfg: RunConfig, run_id: str = "0", output_dir: str | Path | None = None,
                 aggregator: TrunkAggregator | None = None, *, app: str = "", strategy_class: str = "") -> None:
        from splitfed.channel.security.tokens import TokenIssuer
        from splitfed.channel.server.trunkserver import TrunkServer
        from splitfed.models.hetero import server_config

        cfg = server_config(cfg)  # with client-cuts, the trunk holds [min a, max b)
        self.cfg = cfg
        self.run_id = str(run_id)
        self.output_dir = Path(output_dir or cfg.output_dir)
        self.cuts = model_cuts(cfg)
        # A pretrained model's client parts are never read here (clients read their own copy).
        self.split = build_parts(cfg, ("trunk",) if is_pretrained(cfg) else ALL_ROLES)
        trunk = self.split.trunk
        if cfg.trunk_replicas > 1:  # one GPU per replica when there are enough, else CPU (see splitfed.run.launcher)
            from splitfed.run.launcher import replica_device

            trunk.to(replica_device(0, cfg.trunk_replicas))
        from splitfed.run.launcher import runner_runtime

        # sync aggregation global over the replicas when there are some; a researcher's own aggregator otherwise
        self.runtime = runner_runtime(cfg, trunk, aggregator)
        self._secret = secrets.token_bytes(32)  # replicas verify the same tokens
        self.tokens = TokenIssuer(self.run_id, secret=self._secret, ttl_s=cfg.token_ttl) if cfg.auth else None
        self.replicas: Any = None  # a splitfed.run.launcher.ReplicaSet once started, with trunk-replicas > 1
        self.history: list[RoundRecord] = []
        #: The classes that aggregate (``strategy``: the client parts; ``trunk-strategy``: V1's trunk copies),
        #: as ``module.QualName``, for the history.
        self.strategy_classes: dict[str, str] = {"strategy": strategy_class} if strategy_class else {}
        #: Each of those strategies' class and constructor arguments as used (``{"class", "args"}``), for the history.
        self.strategy_settings: dict[str, Any] = {}
        self._status: str | None = None  # the history's status once the run completed or failed
        self.round_offset = 0
        self.client_state = initial_client_state(cfg, self.split)
        #: The inner Flower strategy's own state (server optimizer moments, momentum), by tensor name.
        self.strategy_state: dict[str, torch.Tensor] = {}
        #: Each client's privacy accountants (JSON-able), by client key (its partition id).
        self.privacy_states: dict[str, dict[str, Any]] = {}
        self.tensorboard = RoundWriter.for_run(cfg.tensorboard_dir, self.output_dir)
        self.identity = RunIdentity.of(cfg, self.cuts, app=app, strategy_class=strategy_class)
        if cfg.resume:
            self._resume()
        else:
            self._warn_of_another_run()
        from splitfed.channel.security.policy import ServerTransport

        # Plaintext on loopback, else TLS: the operator's certificate, or one issued now (again on every restart).
        self.transport = ServerTransport.from_config(cfg)
        self.server = TrunkServer(self.runtime, host=cfg.trunk_bind, port=cfg.trunk_port,
                                  insecure=self.transport.insecure, credentials=self.transport.credentials(),
                                  model_name=cfg.model,
                                  cuts=self.cuts, authenticate=None if self.tokens is None else
                                  self.tokens.authenticate,
                                  metrics_port=None if cfg.metrics_port < 0 else cfg.metrics_port,
                                  metrics_host=cfg.trunk_bind, batch_window_ms=cfg.trunk_batch_window_ms,
                                  max_batch_tokens=cfg.trunk_max_batch_tokens,
                                  max_concurrent_rpcs=cfg.trunk_max_concurrent_rpcs,
                                  shared_memory_bytes=cfg.trunk_shared_memory_mib << 20,
                                  bulk_connections=cfg.bulk_connections,
                                  bulk_tls=self.transport.bulk_context() if cfg.bulk_connections else None,
                                  bulk_port=cfg.bulk_port)
        self._round_started = time.monotonic()

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> ServerRunner:
        """Start the trunk server."""
        self.server.start()
        if self.cfg.trunk_replicas > 1:
            from functools import partial

            from splitfed.run.launcher import ReplicaSet, advertised, config_replica

            args = (self.cfg.to_mapping(), self.run_id, str(self.output_dir),
                    self._secret if self.tokens is not None else None, self.transport)
            self.replicas = ReplicaSet(self.server, self.cfg.trunk_replicas, config_replica, args,
                                       advertise=partial(advertised, self.cfg.trunk_advertise),
                                       timeout_s=max(self.cfg.trunk_timeout * 2, 60.0)).start()
        self.transport.write_ca(self.output_dir)  # the CA certificate is public: for operators' health checks
        log.info("SplitFed: trunk (blocks %d..%d of %s) served at %s, clients dial %s; trunk mode %s",
                 self.cuts[0], self.cuts[1] - 1, self.cfg.model, self.server.address, self.advertised_address,
                 self.runtime.aggregator.describe())
        return self

    def stop(self) -> None:
        """Stop the trunk server and its replicas (and close the TensorBoard writer)."""
        if self.replicas is not None:
            self.replicas.stop()
        self.server.stop(grace=1.0)
        self.tensorboard.close()

    @property
    def advertised_address(self) -> str:
        """The address clients dial: ``trunk-advertise``, else the bound one."""
        if self.cfg.trunk_advertise:
            return self.cfg.trunk_advertise
        if self.cfg.trunk_bind in ("0.0.0.0", "::", "[::]"):
            return f"127.0.0.1:{self.server.port}"
        return self.server.address  # brackets an IPv6 host

    @property
    def rounds_left(self) -> int:
        """Rounds still to run (fewer after resuming)."""
        return max(self.cfg.num_server_rounds - self.round_offset, 0)

    # -- per message ------------------------------------------------------------------------------
    def trunk_config(self, node_id: int, server_round: int) -> dict[str, str | int]:
        """What a client needs to reach the trunk this round (address, its token, the CA to pin)."""
        address = self.advertised_address if self.replicas is None else self.replicas.address_for(node_id)
        out: dict[str, str | int] = {TRUNK_ADDRESS: address, SERVER_ROUND: server_round}
        self.transport.round_notice(server_round)
        if self.transport.ca_pem is not None:
            out[TRUNK_CA] = self.transport.ca_pem
        if self.tokens is not None:
            out[TRUNK_TOKEN] = self.tokens.issue(node_id, server_round)
        return out

    def begin_round(self, server_round: int, node_ids: list[int]) -> None:
        """Tell the trunk the round's participants (per-client copies, sequential turns), by Flower node id."""
        # Clients are named on the trunk as their tokens name them (splitfed.channel.security.tokens.Claims.client_id).
        self.runtime.aggregator.begin_round(server_round, [f"node-{n}" for n in node_ids])

    def trunk_metrics(self) -> dict[str, float]:
        """The trunk's counters (version, steps, outcomes, evictions)."""
        agg = self.runtime.aggregator
        out = {"trunk-version": float(self.runtime.version), "trunk-evicted": float(self.runtime.store.evicted)}
        out.update({f"trunk-{k}": float(v) for k, v in agg.stats.items()})
        if self.replicas is not None:
            out["trunk-replicas-live"] = float(len(self.replicas.live()))
        return out

    # -- per round ----------------------------------------------------------------------------------
    def end_round(self, server_round: int, client_state: Mapping[str, torch.Tensor] | None,
                  train_metrics: Mapping[str, float] | None, eval_metrics: Mapping[str, float] | None,
                  failures: Mapping[str, Any] | None = None,
                  strategy_state: Mapping[str, torch.Tensor] | None = None, *,
                  trunk: Mapping[str, float] | None = None, central: Mapping[str, float] | None = None) -> None:
        """Record the round, checkpoint trunk + client parts + strategy and privacy state + history, log a line.

        ``trunk``: counters of the round's trunk aggregation to record beside the trunk's own (V1's copies);
        ``central``: the ServerApp's own evaluation of the round's model."""
        if client_state is not None:
            self.client_state = {k: v.detach().clone() for k, v in client_state.items()}
        if strategy_state is not None:
            self.strategy_state = {k: v.detach().clone() for k, v in strategy_state.items()}
        record = self._record(server_round, train_metrics, eval_metrics, failures)
        record.trunk.update({k: float(v) for k, v in (trunk or {}).items()})
        record.central = {k: float(v) for k, v in (central or {}).items()}
        log.debug("round %d trunk counters: %s", server_round, record.trunk)
        epsilon = max((v for k, v in record.train.items() if k.endswith("epsilon")), default=None)
        if epsilon is not None and self.server.metrics is not None:
            self.server.metrics.set_epsilon(float(epsilon))
        if self.replicas is not None:
            self.replicas.end_round()  # async/quorum: average the replicas; rank 0 then holds what is saved
        self.checkpoint(server_round)
        ev = record.evaluate
        log.info("round %d done in %.1fs: train loss %.4f, eval loss %s, eval accuracy %s, trunk version %d%s",
                 server_round, record.seconds, record.train.get("train-loss", float("nan")),
                 f"{ev['eval-loss']:.4f}" if "eval-loss" in ev else "-",
                 f"{ev['eval-accuracy']:.4f}" if "eval-accuracy" in ev else "-", self.runtime.version,
                 f"; {record.failures['train']} of {record.failures['train-sent']} clients failed: "
                 f"{record.failures.get('first-error')}" if record.failures.get("train") else "")

    def fail_round(self, server_round: int, failures: Mapping[str, Any], error: str) -> None:
        """Record a round that did not train and write the history with the run's error.

        Nothing is checkpointed and no model is exported: the last good checkpoint stays current.
        """
        self._record(server_round, None, None, failures)
        log.error("round %d failed: %s", server_round, error)
        self._write_history(status="failed", error=error)

    def fail_run(self, error: str) -> None:
        """Write the history of a run that stopped on ``error`` (its finished rounds kept), unless a failed
        round already did, or the run completed."""
        if self._status is None:
            log.error("the run failed: %s", error)
            self._write_history(status="failed", error=error)

    def _record(self, server_round: int, train_metrics: Mapping[str, float] | None,
                eval_metrics: Mapping[str, float] | None, failures: Mapping[str, Any] | None) -> RoundRecord:
        now = time.monotonic()
        record = RoundRecord(server_round, dict(train_metrics or {}), dict(eval_metrics or {}), self.trunk_metrics(),
                             now - self._round_started, dict(failures or {}))
        self._round_started = now
        self.history = [r for r in self.history if r.round != server_round] + [record]
        self.tensorboard.write(record)
        return record

    def record_privacy_state(self, client_key: str, state: Mapping[str, Any]) -> None:
        """Keep a client's privacy accountants (from its train reply) for checkpoints and later rounds."""
        self.privacy_states[str(client_key)] = dict(state)

    def checkpoint(self, server_round: int) -> Path:
        """Write trunk, optimizer, client parts, strategy and privacy state and history for ``server_round``.

        See :mod:`splitfed.run.checkpoint`: files are fsynced and the switch is one atomic rename,
        so a crash at any point leaves the previous checkpoint current and whole.
        """
        state = self.runtime.state_dict()
        trunk_state = trainable_state(self.runtime.trunk) if self.cfg.lora_rank else state["trunk"]
        optimizer: dict[str, torch.Tensor] = {}
        optimizer_doc = flatten(state["optimizer"], optimizer)
        meta = {"trunk-version": state["version"], "model": self.cfg.model, "cuts": list(self.cuts),
                META_KEY: self.identity.to_meta(), "optimizer": optimizer_doc, "privacy": self.privacy_states,
                "history": [r.__dict__ for r in self.history]}
        tensors = {"trunk": dict(trunk_state), "clients": dict(self.client_state), "optimizer": optimizer,
                   "strategy": dict(self.strategy_state)}
        return write_checkpoint(self.output_dir, server_round, Checkpoint(tensors, meta))

    def _warn_of_another_run(self) -> None:
        """A fresh run whose output-dir holds another run's checkpoint says so: its first round replaces it."""
        try:
            meta = json.loads((self.output_dir / CURRENT / STATE).read_text())
        except (OSError, ValueError):
            return
        saved = RunIdentity.from_meta(meta)
        diffs = [] if saved is None else self.identity.differences(saved)
        if diffs:
            log.warning("%s holds the checkpoint of another run (%s); this run's rounds replace it (set output-dir "
                        "to keep both)", self.output_dir, "; ".join(diffs[:3]) + ("; ..." if len(diffs) > 3 else ""))

    def _resume(self) -> None:
        saved = read_checkpoint(self.output_dir, accept=lambda meta: self.identity.check_resume(meta,
                                                                                                self.output_dir))
        meta = saved.meta
        optimizer = unflatten(meta["optimizer"], saved.tensors.get("optimizer", {}))
        self.runtime.load_state_dict({"trunk": saved.tensors["trunk"], "optimizer": optimizer,
                                      "version": meta["trunk-version"]}, strict=not self.cfg.lora_rank)
        self.client_state = saved.tensors["clients"]
        self.strategy_state = saved.tensors.get("strategy", {})
        self.privacy_states = {str(k): dict(v) for k, v in meta.get("privacy", {}).items()}
        self.round_offset = int(meta["round"])
        self.history = [RoundRecord(**r) for r in meta.get("history", [])]
        log.warning("resuming from the checkpoint of round %d in %s (trunk version %d)", self.round_offset,
                    saved.folder, self.runtime.version)

    # -- end of run ------------------------------------------------------------------------------------
    def finish(self) -> Path:
        """Export the trained model and write the history; returns the output folder."""
        from splitfed.models.export import export_model

        if is_pretrained(self.cfg) or self.cfg.lora_rank:
            full = full_split_for_export(self.cfg, self.runtime.trunk.state_dict(), self.client_state)
        else:
            load_client_state(self.split, self.client_state, full_keys=bool(self.cfg.client_cuts))
            full = self.split
        export_model(full, self.cfg.model, self.cuts, self.output_dir / "model")
        if is_pretrained(self.cfg):
            tokenizer_for(self.cfg).save_pretrained(self.output_dir / "model")
        history = self._write_history(status="completed")
        from splitfed.errors import MissingExtraError
        from splitfed.run.report import plot, summary_table

        try:
            plot(history, self.output_dir)
        except MissingExtraError as exc:
            log.warning("no PNG plots: %s", exc)
        log.info("SplitFed: run finished\n%s\nResults (model, history.json, plots) are in %s\n"
                 "  splitfed report %s", summary_table(history), self.output_dir, self.output_dir)
        return self.output_dir

    def _write_history(self, status: str, error: str | None = None) -> dict[str, Any]:
        """Write ``history.json`` (settings, run id, status, rounds; the error of a failed run)."""
        self._status = status
        history: dict[str, Any] = {"config": self.cfg.to_mapping(), "run-id": self.run_id, "status": status,
                                   "strategy-classes": dict(self.strategy_classes),
                                   "strategies": dict(self.strategy_settings),
                                   "rounds": [r.__dict__ for r in sorted(self.history, key=lambda r: r.round)]}
        if error is not None:
            history["error"] = error
        self.output_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.output_dir / f".history-{self.run_id}.json"
        tmp.write_text(json.dumps(history, indent=1))
        tmp.replace(self.output_dir / "history.json")
        return history
