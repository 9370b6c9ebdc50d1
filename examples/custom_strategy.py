"""A custom Flower strategy around ``SplitFed``: FedAvg that bounds each client's update before averaging.

``python examples/custom_strategy.py`` aggregates two client updates, one of
them 100 times too large, with FedAvg and with this strategy, and prints how far
each moved the global model.

``SplitFed`` wraps any Flower strategy: it adds the trunk's address and tokens
to the messages, checkpoints and records the rounds, and leaves the aggregation
of the client parts to the strategy, exactly as Flower would. So a strategy of
your own is a Flower strategy: subclass one and override its hooks
(``configure_train``, ``aggregate_train``, ...). The same class can merge the
per-client trunk copies of ``trunk-mode = "per-client"`` (``trunk_strategy``).

To run it in a Flower run, point the ServerApp at this module's ``app``
(``serverapp = "examples.custom_strategy:app"`` in ``[tool.flwr.app.components]``,
and add ``"examples/*.py"`` to ``fab-include``); its ``app`` is the project's
ServerApp with this strategy (``apps.server_app.run``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, Metadata, MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from splitfed.apps.server_app import run  # noqa: E402
from splitfed.config import RunConfig  # noqa: E402
from splitfed.strategies.metrics import aggregate_split_metrics  # noqa: E402


class ClippedFedAvg(FedAvg):
    """FedAvg over client updates whose L2 norm (``w_client - w_global``, all floating tensors) is at most
    ``max_update_norm``; larger ones are scaled down to it."""

    def __init__(self, max_update_norm: float = 1.0, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.max_update_norm = max_update_norm
        self._global: dict[str, torch.Tensor] | None = None
        self.clipped = 0

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                        ) -> Iterable[Message]:
        self._global = arrays.to_torch_state_dict()  # the round's starting point
        return super().configure_train(server_round, arrays, config, grid)

    def _clip(self, reply: Message) -> Message:
        assert self._global is not None
        state = reply.content["arrays"].to_torch_state_dict()
        floating = [k for k, v in state.items() if v.is_floating_point()]
        norm = float(sum(((state[k] - self._global[k]) ** 2).sum() for k in floating)) ** 0.5
        if norm <= self.max_update_norm:
            return reply
        self.clipped += 1
        scale = self.max_update_norm / norm
        for k in floating:
            state[k] = self._global[k] + (state[k] - self._global[k]) * scale
        content = RecordDict(dict(reply.content.items()))
        content["arrays"] = ArrayRecord(torch_state_dict=state)
        return Message(content=content, metadata=reply.metadata)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = [r if r.has_error() or self._global is None else self._clip(r) for r in replies]
        return super().aggregate_train(server_round, replies)


def build(cfg: RunConfig, max_update_norm: float = 5.0) -> ClippedFedAvg:
    """The strategy set up from the run config as ``strategies.build_strategy`` sets up FedAvg."""
    return ClippedFedAvg(max_update_norm, fraction_train=cfg.fraction_train, fraction_evaluate=cfg.fraction_evaluate,
                         min_train_nodes=cfg.min_train_nodes, min_evaluate_nodes=cfg.min_train_nodes,
                         min_available_nodes=cfg.min_train_nodes, train_metrics_aggr_fn=aggregate_split_metrics,
                         evaluate_metrics_aggr_fn=aggregate_split_metrics)


app = ServerApp()


@app.main()
def main_app(grid: Grid, context: Context) -> None:
    """The project's ServerApp with ``ClippedFedAvg`` on the client parts, and on the per-client trunk copies when
    ``trunk-mode = "per-client"`` (the other modes keep one trunk, which takes no strategy)."""
    per_client = context.run_config.get("trunk-mode") == "per-client"
    run(grid, context, strategy=build, trunk_strategy=build if per_client else None)


def _reply(node: int, state: dict[str, torch.Tensor], examples: int) -> Message:
    """A train reply as a ClientApp would send it."""
    metadata = Metadata(run_id=0, message_id=str(node), src_node_id=node, dst_node_id=0, reply_to_message_id="",
                        group_id="", created_at=time.time(), ttl=60.0, message_type="train")
    content = RecordDict({"arrays": ArrayRecord(torch_state_dict=state),
                          "metrics": MetricRecord({"num-examples": examples})})
    return Message(content=content, metadata=metadata)


def main() -> dict[str, float]:
    """How far FedAvg and ClippedFedAvg move a global model when one of two clients sends a huge update."""
    torch.manual_seed(0)
    global_state = {"w": torch.zeros(100)}
    updates = [torch.randn(100) * 0.1, torch.randn(100) * 10.0]  # the second client is off by far
    replies = [_reply(i + 1, {"w": u}, 32) for i, u in enumerate(updates)]
    moved = {}
    clipped = ClippedFedAvg(max_update_norm=1.0)
    clipped._global = global_state  # what configure_train keeps in a run
    for name, strategy in (("fedavg", FedAvg()), ("clipped-fedavg", clipped)):
        arrays, _ = strategy.aggregate_train(1, replies)
        assert arrays is not None
        moved[name] = float(arrays.to_torch_state_dict()["w"].norm())
        sys.stdout.write(f"{name:<16} moved the global model by {moved[name]:.3f}\n")
    return moved


if __name__ == "__main__":
    main()
