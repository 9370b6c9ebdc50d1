"""Flower strategies by name, set up from the run configuration."""

from __future__ import annotations

from flwr.serverapp.strategy import (
    Bulyan,
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
    FedYogi,
    Krum,
    MultiKrum,
    Strategy,
)

from splitfed.config import RunConfig
from splitfed.errors import ConfigError
from strategies.metrics import aggregate_split_metrics

_CLASSES: dict[str, type[Strategy]] = {
    "fedavg": FedAvg, "fedprox": FedProx, "fedadam": FedAdam, "fedavgm": FedAvgM, "fedadagrad": FedAdagrad,
    "fedyogi": FedYogi, "fedmedian": FedMedian, "fedtrimmedavg": FedTrimmedAvg, "krum": Krum,
    "multikrum": MultiKrum, "bulyan": Bulyan,
}


def build_strategy(cfg: RunConfig) -> Strategy:
    """The Flower strategy named by ``strategy`` that aggregates the client parts."""
    try:
        cls = _CLASSES[cfg.strategy]
    except KeyError:
        raise ConfigError(f"strategy must be one of {', '.join(_CLASSES)}; got {cfg.strategy!r}") from None
    kwargs: dict[str, object] = dict(
        fraction_train=cfg.fraction_train, fraction_evaluate=cfg.fraction_evaluate,
        min_train_nodes=cfg.min_train_nodes, min_evaluate_nodes=cfg.min_train_nodes,
        min_available_nodes=cfg.min_train_nodes, train_metrics_aggr_fn=aggregate_split_metrics,
        evaluate_metrics_aggr_fn=aggregate_split_metrics)
    if cls is FedProx:
        kwargs["proximal_mu"] = cfg.proximal_mu
    elif cls in (FedAdam, FedAdagrad, FedYogi):
        kwargs["eta"] = cfg.server_lr
    elif cls is FedAvgM:
        kwargs["server_momentum"] = cfg.server_momentum
    return cls(**kwargs)  # type: ignore[arg-type]
