"""A custom Flower strategy that changes what the clients do: FedAvg with a learning rate that decays every round.

Each round's train message carries ``lr = lr0 * decay ** (round - 1)`` in its ConfigRecord; the project's
ClientApp trains that round with that lr (``splitfed.client.round.round_settings``), so the clients' steps shrink
round by round while the run config keeps one ``lr``.

``python examples/lr_decay.py`` prints the lr each of 5 rounds sends. To run it in a Flower run, point the
ServerApp at this module's ``app`` (``serverapp = "examples.lr_decay:app"`` in ``[tool.flwr.app.components]``,
and add ``"examples/*.py"`` to ``fab-include``). ``python -m bench.strategies --only fedavg lr-decay`` runs the
main job with it and with plain FedAvg on the same data and seed, and prints both accuracies.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from flwr.app import ArrayRecord, ConfigRecord, Context, Message  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from splitfed.apps.server_app import run  # noqa: E402
from splitfed.config import RunConfig  # noqa: E402
from splitfed.strategies.metrics import aggregate_split_metrics  # noqa: E402

#: The factor the lr is multiplied by every round.
DECAY = 0.5


class LrDecayFedAvg(FedAvg):
    """FedAvg whose train messages carry ``lr = lr0 * decay ** (round - 1)``."""

    def __init__(self, lr0: float, decay: float = DECAY, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.lr0, self.decay = lr0, decay

    def lr(self, server_round: int) -> float:
        """The lr the clients train with in ``server_round`` (1-based)."""
        return self.lr0 * self.decay ** (server_round - 1)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                        ) -> Iterable[Message]:
        config = ConfigRecord({**dict(config), "lr": self.lr(server_round)})
        return super().configure_train(server_round, arrays, config, grid)


def build(cfg: RunConfig, decay: float = DECAY) -> LrDecayFedAvg:
    """The strategy set up from the run config (its ``lr`` is round 1's) as ``strategies.build_strategy`` sets up
    FedAvg."""
    return LrDecayFedAvg(cfg.lr, decay, fraction_train=cfg.fraction_train, fraction_evaluate=cfg.fraction_evaluate,
                         min_train_nodes=cfg.min_train_nodes, min_evaluate_nodes=cfg.min_train_nodes,
                         min_available_nodes=cfg.min_train_nodes, train_metrics_aggr_fn=aggregate_split_metrics,
                         evaluate_metrics_aggr_fn=aggregate_split_metrics)


app = ServerApp()


@app.main()
def main_app(grid: Grid, context: Context) -> None:
    """The project's ServerApp with ``LrDecayFedAvg`` on the client parts."""
    run(grid, context, strategy=build)


def main() -> list[float]:
    """The lr that each of 5 rounds sends, from the run config's default lr."""
    strategy = build(RunConfig())
    lrs = [strategy.lr(r) for r in range(1, 6)]
    for r, lr in enumerate(lrs, 1):
        sys.stdout.write(f"round {r}: lr {lr:.5f}\n")
    return lrs


if __name__ == "__main__":
    main()
