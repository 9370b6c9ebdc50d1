"""SplitFed ServerApp: serves the trunk, runs the rounds through a Flower strategy, exports the model."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy

from splitfed.config import RunConfig
from splitfed.logs import setup_logging
from splitfed.server import ServerRunner
from splitfed.trunk.aggregation import TrunkAggregator
from strategies import SplitFed, build_strategy

log = logging.getLogger("splitfed")

app = ServerApp()


def output_dir(cfg: RunConfig) -> Path:
    """``output-dir``; a relative path is taken from $SPLITFED_OUTPUT_ROOT, else the working directory (the
    SuperLink's: for ``flwr run . local``, the folder the local SuperLink was first started from)."""
    path = Path(cfg.output_dir).expanduser()
    if path.is_absolute():
        log.info("SplitFed: outputs go to %s", path)
        return path
    root = os.environ.get("SPLITFED_OUTPUT_ROOT")
    path = Path(root or os.getcwd()) / path
    log.info("SplitFed: outputs go to %s (output-dir %r, relative to %s)", path, cfg.output_dir,
             "$SPLITFED_OUTPUT_ROOT" if root else "the SuperLink's working directory; set $SPLITFED_OUTPUT_ROOT "
             "where the SuperLink starts, or an absolute output-dir, to choose")
    return path


def _fab_id(grid: Grid) -> str:
    """The Flower app's id (``publisher/name``), where the grid knows its run."""
    try:
        return str(grid.run.fab_id)
    except Exception:  # noqa: BLE001 - a grid without run details (in-process tests)
        return ""


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run SplitFed for ``num-server-rounds`` rounds (or what is left after a resume)."""
    run(grid, context)


def run(grid: Grid, context: Context, *, strategy: Callable[[RunConfig], Strategy] | None = None,
        trunk_strategy: Callable[[RunConfig], Strategy] | None = None,
        aggregator: Callable[[RunConfig], TrunkAggregator] | None = None) -> None:
    """The ServerApp's work. A ServerApp of your own passes its own pieces, each built from the run config: the
    Flower ``strategy`` for the client parts (default: ``strategy``), the ``trunk_strategy`` that merges
    per-client trunk copies (default: ``trunk-strategy``), the trunk's ``aggregator`` (default: ``trunk-mode``)."""
    cfg = RunConfig.from_mapping(context.run_config)
    setup_logging(cfg.log_level, json_lines=cfg.log_json, run_id=context.run_id)
    inner = (strategy or build_strategy)(cfg)
    runner = ServerRunner(cfg, run_id=str(context.run_id), output_dir=output_dir(cfg),
                          aggregator=None if aggregator is None else aggregator(cfg), app=_fab_id(grid),
                          strategy_class=type(inner).__name__).start()
    try:
        if runner.rounds_left:
            rounds = SplitFed(inner, runner, trunk_strategy=None if trunk_strategy is None else trunk_strategy(cfg))
            rounds.start(grid, ArrayRecord(torch_state_dict=runner.client_state), num_rounds=runner.rounds_left,
                         timeout=cfg.trunk_timeout * 10 + 600.0, train_config=ConfigRecord({"lr": cfg.lr}),
                         evaluate_config=ConfigRecord())
        else:
            log.warning("all %d rounds are already done in %s", cfg.num_server_rounds, runner.output_dir)
        runner.finish()
    finally:
        runner.stop()
