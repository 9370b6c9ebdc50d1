"""What a client does with one round's message, independent of Flower.

:func:`client_train` trains the client parts (bottom and top) against the remote
trunk; :func:`client_evaluate` evaluates them; :func:`connect_trunk` opens the
channel to the run's trunk server.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from splitfed.codec.tensors import torch_dtype, wire_dtype
from splitfed.config import RunConfig
from splitfed.data import Splits, batches
from splitfed.optim import make_optimizer
from splitfed.models.parts import CLIENT_ROLES, build_parts, client_state, load_client_state, state_nbytes
from splitfed.privacy import ClientPrivacy, PrivacyConfig, install_eval_noise
from splitfed.split import SplitModel
from splitfed.split.microbatch import resolve_micro_batches
from splitfed.client.training import evaluate, perplexity, train

log = logging.getLogger(__name__)

#: The metric Flower's QFedAvg reads each client's training loss from (its ``train_loss_key`` default).
QFEDAVG_LOSS = "train_loss"


@dataclass
class ClientResult:
    """A client's reply: its updated parts and what it measured."""

    state: dict[str, torch.Tensor]
    metrics: dict[str, float | int]
    privacy_state: dict[str, Any] = field(default_factory=dict)  # the DP accountant, kept across rounds


def micro_batches(cfg: RunConfig, split: SplitModel, trunk: nn.Module | None = None) -> int:
    """The run's ``micro-batches`` for this model: the number, or for ``auto`` the rule of
    :func:`~splitfed.split.microbatch.resolve_micro_batches` with the cut's bytes per example (hidden size x
    ``max-seq-len`` x the wire dtype's size for transformers; other models: 1). ``auto`` is 1 where the cut goes
    through shared memory (``trunk``'s client shares the trunk's host): there pipelining costs more per-call work
    than it saves. With differential privacy: 1 (opacus needs one forward per batch)."""
    if PrivacyConfig.from_mapping(cfg.to_mapping()).enabled:
        if cfg.micro_batches != "1":
            log.info("micro-batches = %s ignored: differentially private training runs whole batches",
                     cfg.micro_batches)
        return 1
    shared = getattr(getattr(trunk, "client", None), "shared", None)
    if cfg.micro_batches == "auto" and shared is not None and shared.mode == "on":
        return 1
    hidden = getattr(split.config, "hidden_size", None)
    per_example = 0 if hidden is None else int(hidden) * cfg.max_seq_len * torch_dtype(wire_dtype(cfg.wire_dtype)
                                                                                        ).itemsize
    return resolve_micro_batches(cfg.micro_batches, cfg.batch_size, per_example)


def _client_model(cfg: RunConfig, state: Mapping[str, torch.Tensor], trunk: nn.Module) -> SplitModel:
    split = build_parts(cfg, CLIENT_ROLES)
    load_client_state(split, state, full_keys=bool(cfg.client_cuts))
    return SplitModel(split.bottom, trunk, split.top, task=split.task, config=split.config,
                      micro_batches=micro_batches(cfg, split, trunk))


def connect_trunk(cfg: RunConfig, address: str, token: str | None, client_id: str,
                  ca_pem: str | None = None) -> nn.Module:
    """A :class:`~splitfed.channel.client.remote.RemoteTrunk` to the run's trunk server.

    TLS pinned to ``ca_pem`` (the CA the server sent), else TLS verified with ``tls-root-ca`` when the run has
    ``tls-cert``; plaintext only to a loopback address unless ``trunk-allow-plaintext-remote``. Over TLS the
    client presents ``tls-client-cert``/``tls-client-key`` (required when the run sets ``tls-client-ca``; pass
    the node's view of the config, :meth:`RunConfig.for_node`).
    """
    from splitfed.channel.client.remote import RemoteTrunk
    from splitfed.channel.client.trunk import RetryPolicy
    from splitfed.codec.compression import WireCompression

    from splitfed.channel.security.policy import client_bulk_tls, client_credentials

    credentials = client_credentials(address, pinned_ca=ca_pem, own_tls=bool(cfg.tls_cert), root_ca=cfg.tls_root_ca,
                                     allow_plaintext_remote=cfg.trunk_allow_plaintext_remote,
                                     client_cert=cfg.tls_client_cert, client_key=cfg.tls_client_key,
                                     client_cert_required=bool(cfg.tls_client_ca))
    # Micro-batches in flight travel over several connections (at most 4).
    lanes = 1 if cfg.micro_batches == "1" else 4 if cfg.micro_batches == "auto" else min(int(cfg.micro_batches), 4)
    return RemoteTrunk(address, client_id=client_id, insecure=credentials is None, credentials=credentials,
                       token=token, wire_dtype=cfg.wire_dtype,
                       wire_compression=WireCompression.of(
                           cfg.wire_compression, act=cfg.wire_compression_act, grad=cfg.wire_compression_grad,
                           topk_ratio=cfg.topk_ratio, error_feedback=cfg.wire_error_feedback),
                       retry=RetryPolicy(timeout_s=_call_timeout(cfg)),
                       cut=cfg.cuts if cfg.client_cuts else None, channels=lanes, max_in_flight=2 * lanes,
                       shared_memory=cfg.shared_memory, bulk_connections=cfg.bulk_connections,
                       bulk_tls=client_bulk_tls(pinned_ca=ca_pem, root_ca=cfg.tls_root_ca,
                                                client_cert=cfg.tls_client_cert, client_key=cfg.tls_client_key)
                       if credentials is not None and cfg.bulk_connections else None)


def _call_timeout(cfg: RunConfig) -> float:
    """How long one trunk call may take; in sequential mode a Join waits for the other clients' turns, so it may
    take as long as the ServerApp waits for a round."""
    if cfg.trunk_mode == "sequential":
        return cfg.trunk_timeout * 10 + 600.0
    return max(cfg.trunk_timeout * 3, 60.0)


def _proximal(parts: nn.Module, mu: float) -> Any:
    """FedProx: add ``mu * (w - w_global)`` to every gradient before the step."""
    anchors = [(p, p.detach().clone()) for p in parts.parameters() if p.requires_grad]

    def add_term() -> None:
        with torch.no_grad():
            for p, p0 in anchors:
                if p.grad is not None:
                    p.grad.add_(p - p0, alpha=mu)
    return add_term


#: Keys of a round's config (the strategy's ConfigRecord) that set the client's training for that round.
TRAIN_KEYS = ("lr", "local-steps", "local-epochs", "batch-size", "momentum", "weight-decay", "optimizer")
#: Keys of an evaluate round's config that set the client's evaluation.
EVALUATE_KEYS = ("batch-size", "eval-batches")


def round_settings(cfg: RunConfig, round_config: Mapping[str, Any] | None, keys: tuple[str, ...] = TRAIN_KEYS
                   ) -> RunConfig:
    """``cfg`` with what the strategy sent for this round: the :data:`TRAIN_KEYS` (or ``keys``) present in
    ``round_config`` override the run config. ``local-steps`` without ``local-epochs`` means steps (epochs 0).

    Raises:
        ConfigError: a value of the wrong type or out of range (the key is named).
    """
    values = {k: v for k, v in (round_config or {}).items() if k in keys}
    if "local-steps" in values and "local-epochs" not in values:
        values["local-epochs"] = 0
    return cfg.updated(values) if values else cfg


def client_train(cfg: RunConfig, state: Mapping[str, torch.Tensor], trunk: nn.Module, splits: Splits,
                 server_round: int, partition_id: int, proximal_mu: float = 0.0,
                 privacy_state: Mapping[str, Any] | None = None,
                 round_config: Mapping[str, Any] | None = None) -> ClientResult:
    """One round of local training: returns the updated bottom/top state and the round's metrics.

    ``round_config`` is what the strategy sent this round (its ConfigRecord, SplitFed's own keys removed):
    ``lr``, ``local-steps``/``local-epochs`` and the other :data:`TRAIN_KEYS` override the run config, and
    ``proximal-mu`` (FedProx) overrides ``proximal_mu``; other keys are a researcher's own, for code of theirs.

    With differential privacy on (``dp-*``, ``cut-*`` keys), training runs under
    :class:`~splitfed.privacy.ClientPrivacy` (opacus DP-SGD on the client parts, noise at
    the cut) and ``privacy_state`` carries the accountant from round to round.
    """
    cfg = round_settings(cfg, round_config)
    if round_config is not None and "proximal-mu" in round_config:
        proximal_mu = float(round_config["proximal-mu"])
    model = _client_model(cfg, state, trunk)
    parts = model.client_modules()
    optimizer = make_optimizer(cfg.optimizer, parts.parameters(), cfg.lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay)
    before_step = _proximal(parts, proximal_mu) if proximal_mu > 0 else None
    seed = cfg.seed * 100_003 + server_round * 1009 + partition_id
    if cfg.local_epochs:
        data = batches(splits.train, cfg.batch_size, splits.kind, seed=seed, epochs=cfg.local_epochs)
        steps = cfg.local_epochs * -(-len(splits.train) // cfg.batch_size)
    else:
        data = batches(splits.train, cfg.batch_size, splits.kind, seed=seed)
        steps = cfg.local_steps
    privacy = PrivacyConfig.from_mapping(cfg.to_mapping())
    progress = f"round {server_round} local training"
    if privacy.enabled:
        with ClientPrivacy(privacy, model, optimizer, dataset_size=len(splits.train), batch_size=cfg.batch_size,
                           steps=steps, planned_steps=cfg.num_server_rounds * steps, state=privacy_state,
                           after_noise=before_step) as private:
            report = train(model, private.optimizer, private.batches(splits.train, splits.kind), steps,
                           before_step=private.before_step, autocast_dtype=_autocast(cfg), progress=progress)
            metrics = {**report.metrics("train-"), **private.metrics()}
            metrics["num-examples"] = private.expected_examples()
            new_privacy_state = private.state_dict()
    else:
        report = train(model, optimizer, data, steps, before_step=before_step, autocast_dtype=_autocast(cfg),
                       progress=progress)
        metrics = report.metrics("train-")
        metrics["num-examples"] = report.num_examples
        new_privacy_state = {}
    new_state = client_state(SplitModel(model.bottom, model.trunk, model.top, task=model.task),
                             full_keys=bool(cfg.client_cuts))
    metrics["train-state-bytes"] = state_nbytes(new_state)
    metrics["train-lr"] = cfg.lr
    metrics[QFEDAVG_LOSS] = metrics["train-loss"]  # the key Flower's QFedAvg reads the training loss under
    return ClientResult(new_state, metrics, new_privacy_state)


def _autocast(cfg: RunConfig) -> torch.dtype | None:
    return torch.bfloat16 if cfg.precision == "bf16" else None


def client_evaluate(cfg: RunConfig, state: Mapping[str, torch.Tensor], trunk: nn.Module, splits: Splits,
                    round_config: Mapping[str, Any] | None = None) -> dict[str, float | int]:
    """Forward-only evaluation of the global client parts with the trunk on the held-out split.

    ``round_config``: what the strategy sent for this evaluate round; its :data:`EVALUATE_KEYS` override the
    run config."""
    cfg = round_settings(cfg, round_config, EVALUATE_KEYS)
    model = _client_model(cfg, state, trunk)
    noise = install_eval_noise(PrivacyConfig.from_mapping(cfg.to_mapping()), model)
    try:
        report = evaluate(model, batches(splits.test, cfg.batch_size, splits.kind, shuffle=False, epochs=1),
                          max_batches=cfg.eval_batches)
    finally:
        if noise is not None:
            noise.remove()
    metrics = report.metrics("eval-", training=False)
    metrics["num-examples"] = report.num_examples
    if model.task == "causal-lm":
        metrics["eval-perplexity"] = perplexity(report.loss)
    return metrics
