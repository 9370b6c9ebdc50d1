"""SplitFed ServerApp: serves the trunk, runs the rounds through a Flower strategy, exports the model."""

from __future__ import annotations

import logging
from collections.abc import Callable

from flwr.app import ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy

from splitfed.config import RunConfig
from splitfed.trunk.aggregation.modes import TrunkAggregator

if __package__ == "apps":  # the repository's Flower app (`flwr run .`): apps/ beside strategies/
    from strategies import build_strategy
    from strategies.run import output_root as output_dir
    from strategies.run import splitfed_run
else:  # installed: splitfed.apps beside splitfed.strategies
    from ..strategies import build_strategy
    from ..strategies.run import output_root as output_dir
    from ..strategies.run import splitfed_run

log = logging.getLogger("splitfed")

app = ServerApp()

__all__ = ["app", "main", "output_dir", "run"]


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run SplitFed for ``num-server-rounds`` rounds (or what is left after a resume)."""
    run(grid, context)


def run(grid: Grid, context: Context, *, strategy: Callable[[RunConfig], Strategy] | None = None,
        trunk_strategy: Callable[[RunConfig], Strategy] | None = None,
        aggregator: Callable[[RunConfig], TrunkAggregator] | None = None) -> None:
    """The ServerApp's work, through :func:`strategies.run.splitfed_run` (as a ServerApp of your own does). Its
    pieces are each built from the run config: the Flower ``strategy`` for the client parts (default:
    ``strategy``), the ``trunk_strategy`` that merges per-client trunk copies (default: ``trunk-strategy``), the
    trunk's ``aggregator`` (default: ``trunk-mode``)."""
    cfg = RunConfig.from_mapping(context.run_config)
    with splitfed_run(grid, context, aggregator=None if aggregator is None else aggregator(cfg)) as sf:
        rounds = sf.wrap((strategy or build_strategy)(cfg),
                         trunk_strategy=None if trunk_strategy is None else trunk_strategy(cfg))
        if sf.num_rounds:
            rounds.start(grid, sf.initial_arrays, num_rounds=sf.num_rounds, timeout=sf.timeout,
                         train_config=sf.train_config, evaluate_config=ConfigRecord())
        else:
            log.warning("all %d rounds are already done in %s", cfg.num_server_rounds, sf.run_dir)
