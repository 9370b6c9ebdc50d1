"""Flower strategies by name, set up from the run configuration.

``strategy`` names one of Flower's strategies that aggregate arrays (:data:`STRATEGIES`); ``strategy-args``
sets any of its constructor's arguments (``"beta-1=0.8 tau=0.001"``), type-checked against the constructor's
signature. ``dp-wrapper`` wraps it in one of Flower's differential-privacy wrappers (:data:`DP_WRAPPERS`), whose
arguments come from ``dp-args``. ``trunk-strategy`` / ``trunk-strategy-args`` do the same for the strategy that
merges per-client trunk copies. A name the constructor does not take, or a value of the wrong type, is a
:class:`~splitfed.errors.ConfigError` that lists the valid names.
"""

from __future__ import annotations

import inspect
import types
import typing
from typing import Any

from flwr.serverapp.strategy import (
    Bulyan,
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
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
    QFedAvg,
    Strategy,
)

from splitfed.config import RunConfig, parse_args
from splitfed.errors import ConfigError
from .metrics import aggregate_split_metrics

#: Flower's strategies that aggregate arrays, by run-config name. (FedXgbBagging/FedXgbCyclic aggregate
#: serialized XGBoost trees, not tensors: they do not apply to split models.)
STRATEGIES: dict[str, type[Strategy]] = {
    "fedavg": FedAvg, "fedprox": FedProx, "fedadam": FedAdam, "fedavgm": FedAvgM, "fedadagrad": FedAdagrad,
    "fedyogi": FedYogi, "fedmedian": FedMedian, "fedtrimmedavg": FedTrimmedAvg, "krum": Krum,
    "multikrum": MultiKrum, "bulyan": Bulyan, "qfedavg": QFedAvg,
}
#: Flower's differential-privacy wrappers, by ``dp-wrapper`` value.
DP_WRAPPERS: dict[str, type[Strategy]] = {
    "server-fixed": DifferentialPrivacyServerSideFixedClipping,
    "server-adaptive": DifferentialPrivacyServerSideAdaptiveClipping,
    "client-fixed": DifferentialPrivacyClientSideFixedClipping,
    "client-adaptive": DifferentialPrivacyClientSideAdaptiveClipping,
}
_SCALARS = (bool, int, float, str)


def _scalar_type(annotation: Any) -> tuple[type, bool] | None:
    """``(type, optional)`` of an annotation that a run-config string can give; None for any other."""
    if annotation in _SCALARS:
        return annotation, False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1 and args[0] in _SCALARS and len(typing.get_args(annotation)) == 2:
            return args[0], True
    return None


def settable_args(cls: type) -> dict[str, tuple[type, bool]]:
    """The constructor arguments of ``cls`` a run-config string can set: name -> (type, optional)."""
    hints = typing.get_type_hints(cls.__init__)
    out = {}
    for name in inspect.signature(cls.__init__).parameters:
        kind = _scalar_type(hints.get(name))
        if name != "self" and kind is not None:
            out[name] = kind
    return out


def _coerce(text: str, kind: type, optional: bool, where: str) -> Any:
    if optional and text.lower() == "none":
        return None
    try:
        if kind is bool:
            if text.lower() in ("true", "1", "yes"):
                return True
            if text.lower() in ("false", "0", "no"):
                return False
            raise ValueError(text)
        return kind(text)
    except ValueError:
        raise ConfigError(f"{where} must be {kind.__name__}{' or none' if optional else ''}, got {text!r}") from None


def typed_args(cls: type, text: str, key: str) -> dict[str, Any]:
    """``key``'s ``name=value`` pairs as constructor arguments of ``cls``, each of its annotated type.

    Raises:
        ConfigError: a name ``cls`` does not take (the message lists those it takes), or a value of the wrong type.
    """
    valid = settable_args(cls)
    out = {}
    for name, value in parse_args(text, key).items():
        if name not in valid:
            raise ConfigError(f"{key}: {cls.__name__} takes no argument {name!r} that the run config can set; valid "
                              f"names: {', '.join(n.replace('_', '-') for n in valid)}")
        out[name] = _coerce(value, *valid[name], where=f"{key}: {name.replace('_', '-')}")
    return out


def _construct(cls: type, kwargs: dict[str, Any], key: str) -> Any:
    params = inspect.signature(cls.__init__).parameters
    missing = [n for n, p in params.items() if n not in ("self", "strategy") and p.default is p.empty
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n not in kwargs]
    if missing:
        raise ConfigError(f"{cls.__name__} needs {', '.join(n.replace('_', '-') for n in missing)}: set "
                          f"{' '.join(n.replace('_', '-') + '=...' for n in missing)} in {key}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{cls.__name__}({key}): {exc}") from None


def build_strategy(cfg: RunConfig, *, trunk: bool = False) -> Strategy:
    """The Flower strategy that ``strategy`` names, with ``strategy-args``, inside the ``dp-wrapper`` if any.

    With ``trunk=True``: the one that merges per-client trunk copies (``trunk-strategy`` with
    ``trunk-strategy-args``; empty ``trunk-strategy``: ``strategy`` with ``strategy-args``); no DP wrapper.
    ``server-lr`` (``eta``), ``server-momentum`` and ``proximal-mu`` still set those arguments; ``strategy-args``
    wins where both do.

    Raises:
        ConfigError: an unknown strategy or wrapper, an argument the constructor does not take (the message lists
            the valid names), a value of the wrong type, or a required argument missing.
    """
    name, text, key = cfg.strategy, cfg.strategy_args, "strategy-args"
    if trunk and cfg.trunk_strategy:
        name, text, key = cfg.trunk_strategy, cfg.trunk_strategy_args, "trunk-strategy-args"
    elif trunk and cfg.trunk_strategy_args:
        text, key = cfg.trunk_strategy_args, "trunk-strategy-args"
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ConfigError(f"strategy must be one of {', '.join(STRATEGIES)}; got {name!r}") from None
    defaults: dict[str, Any] = dict(
        fraction_train=cfg.fraction_train, fraction_evaluate=cfg.fraction_evaluate,
        min_train_nodes=cfg.min_train_nodes, min_evaluate_nodes=cfg.min_train_nodes,
        min_available_nodes=cfg.min_train_nodes, train_metrics_aggr_fn=aggregate_split_metrics,
        evaluate_metrics_aggr_fn=aggregate_split_metrics, proximal_mu=cfg.proximal_mu, eta=cfg.server_lr,
        server_momentum=cfg.server_momentum, client_learning_rate=cfg.lr)
    params = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in defaults.items() if k in params}
    kwargs.update(typed_args(cls, text, key))
    strategy = _construct(cls, kwargs, key)
    if trunk or not cfg.dp_wrapper:
        return strategy
    try:
        wrapper = DP_WRAPPERS[cfg.dp_wrapper]
    except KeyError:
        raise ConfigError(f"dp-wrapper must be one of {', '.join(DP_WRAPPERS)} (or empty); got "
                          f"{cfg.dp_wrapper!r}") from None
    return _construct(wrapper, {"strategy": strategy, **typed_args(wrapper, cfg.dp_args, "dp-args")}, "dp-args")


def client_clipping(strategy: Strategy) -> str:
    """``"fixed"`` or ``"adaptive"`` when ``strategy`` (or a strategy it wraps) expects the clients to clip
    their updates (Flower's client-side DP wrappers); ``""`` otherwise."""
    seen: Any = strategy
    for _ in range(8):
        if isinstance(seen, DifferentialPrivacyClientSideAdaptiveClipping):
            return "adaptive"
        if isinstance(seen, DifferentialPrivacyClientSideFixedClipping):
            return "fixed"
        seen = getattr(seen, "strategy", None)
        if not isinstance(seen, Strategy):
            return ""
    return ""


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, _SCALARS):
        return value
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
    return repr(value)


def describe_strategy(strategy: Strategy) -> dict[str, Any]:
    """``{"class": module.QualName, "args": {...}}`` of a strategy: each constructor argument's value as the
    object holds it now (an attribute of the same name), and ``"strategy"``: the same for the strategy a wrapper
    wraps. For the history (``history.json``)."""
    cls = type(strategy)
    out: dict[str, Any] = {"class": f"{cls.__module__}.{cls.__qualname__}", "args": {}}
    for name in inspect.signature(cls.__init__).parameters:
        if name in ("self", "strategy") or not hasattr(strategy, name):
            continue
        out["args"][name] = _plain(getattr(strategy, name))
    inner = getattr(strategy, "strategy", None)
    if isinstance(inner, Strategy):
        out["strategy"] = describe_strategy(inner)
    return out


__all__ = ["DP_WRAPPERS", "STRATEGIES", "build_strategy", "client_clipping", "describe_strategy", "settable_args",
           "typed_args"]
