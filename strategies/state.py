"""The inner Flower strategy's own state, as named tensors for checkpoints (and back).

Server-side optimizers keep state between rounds: FedAdam and FedYogi the moments
``m_t`` and ``v_t``, FedAdagrad ``m_t`` and ``v_t``, FedAvgM its ``momentum_vector``.
A resumed run restores them, so its next round updates exactly as the uninterrupted
run would have. ``current_arrays`` needs no saving: every strategy sets it again from
the global arrays (the checkpointed client parts) in ``configure_train``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.serverapp.strategy import Strategy

#: Strategy attributes that hold numpy arrays by name (dict) or by position (list).
STATEFUL = ("m_t", "v_t", "momentum_vector")


def _unwrap(strategy: Strategy) -> list[Any]:
    """The strategy and the ones it wraps (differential-privacy wrappers keep theirs in ``.strategy``)."""
    chain: list[Any] = [strategy]
    while isinstance(getattr(chain[-1], "strategy", None), Strategy):
        chain.append(chain[-1].strategy)
    return chain


def strategy_state(strategy: Strategy) -> dict[str, torch.Tensor]:
    """``{"<depth>/<attr>/<key>": tensor}`` of every stateful attribute that is set."""
    out: dict[str, torch.Tensor] = {}
    for depth, inner in enumerate(_unwrap(strategy)):
        for attr in STATEFUL:
            value = getattr(inner, attr, None)
            if isinstance(value, dict):
                items = value.items()
            elif isinstance(value, (list, tuple)):
                items = ((str(i), v) for i, v in enumerate(value))
            else:
                continue
            for key, array in items:
                out[f"{depth}/{attr}/{'list' if not isinstance(value, dict) else 'dict'}/{key}"] = \
                    torch.from_numpy(np.array(array, copy=True))
    return out


def load_strategy_state(strategy: Strategy, state: dict[str, torch.Tensor]) -> None:
    """Set the attributes :func:`strategy_state` saved (keys of other strategies are ignored)."""
    chain = _unwrap(strategy)
    found: dict[tuple[int, str, str], dict[str, np.ndarray]] = {}
    for name, tensor in state.items():
        depth, attr, kind, key = name.split("/", 3)
        if int(depth) < len(chain) and attr in STATEFUL and hasattr(chain[int(depth)], attr):
            found.setdefault((int(depth), attr, kind), {})[key] = tensor.numpy().copy()
    for (depth, attr, kind), arrays in found.items():
        value: Any = arrays if kind == "dict" else [arrays[str(i)] for i in range(len(arrays))]
        setattr(chain[depth], attr, value)
