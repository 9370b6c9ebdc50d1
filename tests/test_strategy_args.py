"""Every strategy setting per run: ``strategy-args``, ``trunk-strategy-args``, ``dp-wrapper`` and ``dp-args`` set
any constructor argument of Flower's strategies and DP wrappers, type-checked against the constructor."""

from __future__ import annotations

import inspect

import pytest
from flower_harness import default_run_config
from flwr.serverapp import strategy as flower_strategies

from splitfed.config import RunConfig, parse_args
from splitfed.errors import ConfigError
from strategies.factory import DP_WRAPPERS, STRATEGIES, build_strategy, client_clipping, describe_strategy


def _cfg(**overrides: object) -> RunConfig:
    return RunConfig.from_mapping(default_run_config(**overrides))


def test_strategy_args_set_constructor_arguments_of_their_type() -> None:
    strategy = build_strategy(_cfg(strategy="fedadam", strategy_args="beta-1=0.8 tau=0.001 eta_l=0.5"))
    assert (strategy.beta_1, strategy.tau, strategy.eta_l) == (0.8, 0.001, 0.5)
    assert type(strategy.beta_1) is float
    krum = build_strategy(_cfg(strategy="multikrum", strategy_args="num-nodes-to-select=3 num-malicious-nodes=1"))
    assert (krum.num_nodes_to_select, krum.num_malicious_nodes) == (3, 1) and type(krum.num_nodes_to_select) is int
    trimmed = build_strategy(_cfg(strategy="fedtrimmedavg", strategy_args="beta=0.3 weighted-by-key=train-steps"))
    assert trimmed.beta == 0.3 and trimmed.weighted_by_key == "train-steps"


def test_strategy_args_win_over_the_old_keys_which_still_work() -> None:
    assert build_strategy(_cfg(strategy="fedadam", server_lr=0.2)).eta == 0.2
    assert build_strategy(_cfg(strategy="fedadam", server_lr=0.2, strategy_args="eta=0.05")).eta == 0.05
    assert build_strategy(_cfg(strategy="fedprox", proximal_mu=0.3)).proximal_mu == 0.3
    assert build_strategy(_cfg(strategy="fedprox", proximal_mu=0.3, strategy_args="proximal-mu=0.7")).proximal_mu == 0.7
    assert build_strategy(_cfg(strategy="fedavgm", server_momentum=0.5)).server_momentum == 0.5


def test_an_unknown_name_fails_listing_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as err:
        build_strategy(_cfg(strategy="fedadam", strategy_args="beta1=0.8"))
    assert "beta1" in str(err.value) and "beta-1" in str(err.value) and "tau" in str(err.value)
    with pytest.raises(ConfigError, match="train-metrics-aggr-fn|takes no argument"):  # a callable: not settable
        build_strategy(_cfg(strategy="fedavg", strategy_args="train-metrics-aggr-fn=x"))


def test_a_value_of_the_wrong_type_fails_naming_the_argument() -> None:
    with pytest.raises(ConfigError, match="num-nodes-to-select must be int"):
        build_strategy(_cfg(strategy="multikrum", strategy_args="num-nodes-to-select=1.5"))
    with pytest.raises(ConfigError, match="beta-1 must be float"):
        build_strategy(_cfg(strategy="fedadam", strategy_args="beta-1=high"))
    with pytest.raises(ConfigError, match="name=value"):
        _cfg(strategy_args="beta-1")  # caught when the run config is read
    adaptive = build_strategy(_cfg(dp_wrapper="server-adaptive",
                                   dp_args="noise-multiplier=0.05 num-sampled-clients=20 clipped-count-stddev=none"))
    assert adaptive.clipped_count_stddev == 1.0  # none: Flower's own default (num_sampled_clients / 20)


def test_every_array_strategy_flower_ships_can_be_named() -> None:
    shipped = {name for name, obj in vars(flower_strategies).items()
               if inspect.isclass(obj) and issubclass(obj, flower_strategies.Strategy)}
    wrappers = {c.__name__ for c in DP_WRAPPERS.values()}
    named = {c.__name__ for c in STRATEGIES.values()}
    # FedXgb* aggregate serialized XGBoost trees (bytes), not tensors; Strategy is the abstract base.
    assert shipped - named - wrappers == {"Strategy", "FedXgbBagging", "FedXgbCyclic"}
    for name in STRATEGIES:
        assert type(build_strategy(_cfg(strategy=name))) is STRATEGIES[name]
    qfedavg = build_strategy(_cfg(strategy="qfedavg", lr=0.07, strategy_args="q=0.5"))
    assert (qfedavg.client_learning_rate, qfedavg.q) == (0.07, 0.5)


def test_dp_wrappers_by_name_with_their_args() -> None:
    dp = build_strategy(_cfg(strategy="fedprox", dp_wrapper="client-fixed",
                             dp_args="noise-multiplier=1.0 clipping-norm=0.1 num-sampled-clients=4"))
    assert type(dp).__name__ == "DifferentialPrivacyClientSideFixedClipping"
    assert (dp.noise_multiplier, dp.clipping_norm, dp.num_sampled_clients) == (1.0, 0.1, 4)
    assert type(dp.strategy).__name__ == "FedProx" and client_clipping(dp) == "fixed"
    adaptive = build_strategy(_cfg(dp_wrapper="client-adaptive", dp_args="noise-multiplier=0.05 "
                                                                          "num-sampled-clients=20 initial-clipping-norm=0.3"))
    assert client_clipping(adaptive) == "adaptive" and adaptive.clipping_norm == 0.3
    server = build_strategy(_cfg(dp_wrapper="server-fixed", dp_args="noise-multiplier=1 clipping-norm=1 "
                                                                     "num-sampled-clients=2"))
    assert client_clipping(server) == ""
    with pytest.raises(ConfigError, match="needs clipping-norm, num-sampled-clients"):
        build_strategy(_cfg(dp_wrapper="client-fixed", dp_args="noise-multiplier=1"))
    with pytest.raises(ConfigError, match="dp-wrapper must be one of"):
        _cfg(dp_wrapper="local")
    with pytest.raises(ConfigError, match="clipping norm should be a positive"):
        build_strategy(_cfg(dp_wrapper="client-fixed", dp_args="noise-multiplier=1 clipping-norm=0 "
                                                                 "num-sampled-clients=2"))


def test_trunk_strategy_args_set_the_per_client_trunk_strategy() -> None:
    cfg = _cfg(trunk_mode="per-client", strategy="fedadam", strategy_args="beta-1=0.8",
               trunk_strategy="fedtrimmedavg", trunk_strategy_args="beta=0.4")
    trunk = build_strategy(cfg, trunk=True)
    assert type(trunk).__name__ == "FedTrimmedAvg" and trunk.beta == 0.4
    same = build_strategy(_cfg(trunk_mode="per-client", strategy="fedadam", strategy_args="beta-1=0.8"), trunk=True)
    assert same.beta_1 == 0.8  # empty trunk-strategy: the strategy, with strategy-args
    with pytest.raises(ConfigError, match="valid names"):
        build_strategy(_cfg(trunk_mode="per-client", trunk_strategy="krum", trunk_strategy_args="beta=0.1"),
                       trunk=True)


def test_describe_strategy_gives_classes_and_arguments_used() -> None:
    described = describe_strategy(build_strategy(_cfg(strategy="fedadam", strategy_args="beta-1=0.8",
                                                      dp_wrapper="server-fixed",
                                                      dp_args="noise-multiplier=0.5 clipping-norm=2 "
                                                              "num-sampled-clients=3")))
    assert described["class"].endswith("DifferentialPrivacyServerSideFixedClipping")
    assert described["args"]["noise_multiplier"] == 0.5 and described["args"]["num_sampled_clients"] == 3
    assert described["strategy"]["class"] == "flwr.serverapp.strategy.fedadam.FedAdam"
    assert described["strategy"]["args"]["beta_1"] == 0.8
    assert described["strategy"]["args"]["train_metrics_aggr_fn"].endswith("aggregate_split_metrics")


def test_parse_args_accepts_kebab_and_snake_names_and_quotes() -> None:
    assert parse_args("beta-1=0.8 tau=0.001 weighted_by_key='a b'", "k") == {
        "beta_1": "0.8", "tau": "0.001", "weighted_by_key": "a b"}
    with pytest.raises(ConfigError, match="twice"):
        parse_args("tau=1 tau=2", "strategy-args")


def test_flower_parses_the_documented_run_config_override() -> None:
    from flwr.common.config import parse_config_args

    parsed = parse_config_args(["strategy='fedadam' strategy-args='beta-1=0.8 tau=0.001'"])
    cfg = _cfg(**parsed)
    assert build_strategy(cfg).beta_1 == 0.8
