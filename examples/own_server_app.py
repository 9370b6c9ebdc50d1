"""A ServerApp of your own, written as Flower's docs teach: build a strategy, call ``strategy.start``, get a ``Result``.

``splitfed_run`` makes the run's folder and, on ``sf.wrap(...)``, starts the trunk server and wraps
the strategy in ``SplitFed``; leaving the ``with`` block exports the model and writes the history (or,
when something raised, the history of the rounds that finished, marked failed) and stops the trunk.
``evaluate_fn`` is Flower's central evaluation: here the global client parts with the trunk on the
held-out MNIST images; its metrics land in ``Result.evaluate_metrics_serverapp`` and in the history
(``central``).

Run it with ``flwr run``: set ``serverapp = "examples.own_server_app:app"`` under
``[tool.flwr.app.components]`` and add ``"examples/*.py"`` to ``fab-include``.
"""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAdam, Result

from splitfed.client.round import client_evaluate
from splitfed.workload import load_splits
from splitfed.strategies.metrics import aggregate_split_metrics
from splitfed.strategies.run import splitfed_run

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> Result:
    """FedAdam on the client parts, central evaluation after every round; returns Flower's ``Result``."""
    with splitfed_run(grid, context) as sf:
        strategy = FedAdam(eta=0.01, min_train_nodes=2, min_available_nodes=2,
                           train_metrics_aggr_fn=aggregate_split_metrics,
                           evaluate_metrics_aggr_fn=aggregate_split_metrics)

        def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            metrics = client_evaluate(sf.cfg, arrays.to_torch_state_dict(), sf.runner.runtime.trunk,
                                      load_splits(sf.cfg, 0, 1))  # the whole held-out split
            return MetricRecord({k: float(v) for k, v in metrics.items()})

        return sf.wrap(strategy).start(grid=grid, initial_arrays=sf.initial_arrays, num_rounds=sf.num_rounds,
                                       timeout=sf.timeout, train_config=sf.train_config, evaluate_fn=central)
