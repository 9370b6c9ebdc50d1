"""``splitfed_run``: a ServerApp of your own is ordinary Flower, with SplitFed set up and torn down around it.

::

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        with splitfed_run(grid, context) as sf:
            result = sf.wrap(FedAdam(eta=0.01)).start(grid=grid, initial_arrays=sf.initial_arrays,
                                                      num_rounds=sf.num_rounds, evaluate_fn=my_evaluate)

Entering makes the run's own folder (:mod:`splitfed.run.rundirs`: ``<output-dir>/<time>-run<id>``, or the
run ``resume`` names); :meth:`SplitFedRun.wrap` builds the trunk server (a
:class:`~splitfed.run.server.ServerRunner`, started) and wraps the strategy in :class:`SplitFed`; Flower's
``start`` runs the rounds and returns Flower's ``Result``. Leaving exports the model and writes the
history (``status = "completed"``); an exception on the way writes the history of the rounds that finished
with ``status = "failed"`` and the error, and is raised again. The trunk server stops either way.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from splitfed.config import RunConfig
from splitfed.errors import ConfigError
from splitfed.logs import setup_logging
from splitfed.run.rundirs import new_run_dir, point_latest, resolve_resume
from splitfed.run.server import ServerRunner
from splitfed.trunk.aggregation.modes import TrunkAggregator
from .splitfed import SplitFed

log = logging.getLogger("splitfed")


def output_root(cfg: RunConfig) -> Path:
    """``output-dir``; a relative path is taken from $SPLITFED_OUTPUT_ROOT, else the working directory (the
    SuperLink's: for ``flwr run . local``, the folder the local SuperLink was first started from)."""
    path = Path(cfg.output_dir).expanduser()
    if path.is_absolute():
        return path
    return Path(os.environ.get("SPLITFED_OUTPUT_ROOT") or os.getcwd()) / path


def root_note(cfg: RunConfig) -> str:
    """Where a relative ``output-dir`` was taken from, and how to choose (empty for an absolute one)."""
    if Path(cfg.output_dir).expanduser().is_absolute():
        return ""
    if os.environ.get("SPLITFED_OUTPUT_ROOT"):
        return f" (output-dir {cfg.output_dir!r}, relative to $SPLITFED_OUTPUT_ROOT)"
    return (f" (output-dir {cfg.output_dir!r}, relative to the SuperLink's working directory; set "
            "$SPLITFED_OUTPUT_ROOT where the SuperLink starts, or an absolute output-dir, to choose)")


def _fab_id(grid: Grid) -> str:
    """The Flower app's id (``publisher/name``), where the grid knows its run."""
    try:
        return str(grid.run.fab_id)
    except Exception:  # noqa: BLE001 - a grid without run details (in-process tests)
        return ""


class SplitFedRun:
    """One SplitFed run inside a ServerApp (made by :func:`splitfed_run`).

    Attributes:
        cfg: the run config.
        run_dir: this run's folder (checkpoints, history, model, plots).
    """

    def __init__(self, grid: Grid, context: Context, aggregator: TrunkAggregator | None = None) -> None:
        self.grid, self.context = grid, context
        self.cfg = RunConfig.from_mapping(context.run_config)
        self._aggregator = aggregator
        self._runner: ServerRunner | None = None
        root = output_root(self.cfg)
        if self.cfg.resume:
            self.run_dir = resolve_resume(root, self.cfg.resume)
            point_latest(self.run_dir.parent, self.run_dir)  # latest: the run written last
            log.info("SplitFed: resuming the run in %s%s", self.run_dir, root_note(self.cfg))
        else:
            self.run_dir = new_run_dir(root, context.run_id)
            log.info("SplitFed: this run's results go to %s%s", self.run_dir, root_note(self.cfg))

    def wrap(self, strategy: Strategy, trunk_strategy: Strategy | None = None) -> SplitFed:
        """Start the trunk server and wrap ``strategy`` (it aggregates the client parts) in :class:`SplitFed`.

        ``trunk_strategy`` merges V1's per-client trunk copies (``trunk-mode = "per-client"`` only; default: the
        one ``trunk-strategy`` names, else the one ``strategy`` names in the run config).

        Raises:
            ConfigError: ``trunk_strategy`` outside per-client mode, or a second call.
        """
        if self._runner is not None:
            raise ConfigError("splitfed_run wraps one strategy per run: call sf.wrap(...) once")
        self._runner = ServerRunner(self.cfg, run_id=str(self.context.run_id), output_dir=self.run_dir,
                                    aggregator=self._aggregator, app=_fab_id(self.grid),
                                    strategy_class=type(strategy).__name__).start()
        try:
            return SplitFed(strategy, self._runner, trunk_strategy=trunk_strategy)
        except BaseException:
            self._runner.stop()
            self._runner = None
            raise

    @property
    def runner(self) -> ServerRunner:
        """The server side (trunk server, checkpoints, history); built by :meth:`wrap`."""
        if self._runner is None:
            raise ConfigError("call sf.wrap(strategy) before using the run's arrays, rounds or runner")
        return self._runner

    @property
    def initial_arrays(self) -> ArrayRecord:
        """The client parts to start from (initial weights, or the checkpoint's after a resume)."""
        return ArrayRecord(torch_state_dict=self.runner.client_state)

    @property
    def num_rounds(self) -> int:
        """``num-server-rounds``, less the rounds a resumed run already finished."""
        return self.runner.rounds_left

    @property
    def timeout(self) -> float:
        """A round's timeout for ``start`` that outlasts the trunk's own (``trunk-timeout``)."""
        return self.cfg.trunk_timeout * 10 + 600.0

    @property
    def train_config(self) -> ConfigRecord:
        """The clients' train config from the run config (``lr``)."""
        return ConfigRecord({"lr": self.cfg.lr})

    def _close(self, error: BaseException | None) -> None:
        runner = self._runner
        if runner is None:
            return
        try:
            if error is None:
                runner.finish()
            else:
                runner.fail_run(f"{type(error).__name__}: {error}")
        finally:
            runner.stop()


@contextmanager
def splitfed_run(grid: Grid, context: Context, *, aggregator: TrunkAggregator | None = None
                 ) -> Iterator[SplitFedRun]:
    """Set up a SplitFed run for a ServerApp's ``main`` and tear it down (see the module's docstring).

    ``aggregator``: the trunk's aggregator (default: the one ``trunk-mode`` names).
    """
    cfg = RunConfig.from_mapping(context.run_config)
    setup_logging(cfg.log_level, json_lines=cfg.log_json, run_id=context.run_id)
    sf = SplitFedRun(grid, context, aggregator)
    try:
        yield sf
    except BaseException as exc:
        sf._close(exc)
        raise
    sf._close(None)
