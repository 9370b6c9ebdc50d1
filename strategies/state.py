"""Any Flower strategy's own state, as named tensors for checkpoints (and back): one generic mechanism.

What is saved, for the strategy and every strategy it wraps (a DP wrapper's ``.strategy``):

* a strategy with ``state_dict()`` and ``load_state_dict(state)`` saves what ``state_dict()`` returns and gets it
  back through ``load_state_dict`` (write these two for state the rule below misses);
* any other strategy saves each public attribute that holds numbers, numpy arrays or torch tensors, or lists,
  tuples and dicts of them, except the attributes named like an ``__init__`` parameter of its class (settings:
  the run config builds them again). So FedAdam/FedYogi/FedAdagrad's moments ``m_t``/``v_t``, FedAvgM's
  ``momentum_vector``, the adaptive DP wrappers' ``clipping_norm``, a custom strategy's counters are kept;
  ``current_arrays`` (:data:`TRANSIENT`: set again from the checkpointed client parts in ``configure_train``),
  strings, callables and ``_private`` attributes are not.

Every value becomes a tensor (a number a 0-d tensor of its own kind: float64, int64 or bool) named
``<depth>/<attr>/<path>/<kind>``: ``depth`` counts wrappers (0 is the outer one), ``path`` has ``d:<key>`` and
``l:<index>`` steps, ``kind`` is ``np``, ``pt`` or ``py`` (the leaf's type to restore). The checkpoint stores them
with safetensors: nothing is pickled. On load, attributes the strategy does not have are ignored.
"""

from __future__ import annotations

import inspect
from typing import Any
from urllib.parse import quote, unquote

import numpy as np
import torch
from flwr.serverapp.strategy import Strategy

#: Leaf kinds: a numpy array, a torch tensor, a Python number.
_KINDS = ("np", "pt", "py")
#: Attributes that are not state: the round's starting point, set again from the global arrays each round.
TRANSIENT = frozenset({"current_arrays"})


def _unwrap(strategy: Strategy) -> list[Any]:
    """The strategy and the ones it wraps (differential-privacy wrappers keep theirs in ``.strategy``)."""
    chain: list[Any] = [strategy]
    while isinstance(getattr(chain[-1], "strategy", None), Strategy):
        chain.append(chain[-1].strategy)
    return chain


def _settings(obj: Any) -> set[str]:
    """Names of the ``__init__`` parameters of ``obj``'s class and its bases (settings, not state)."""
    names: set[str] = set()
    for cls in type(obj).__mro__:
        init = cls.__dict__.get("__init__")
        if init is not None:
            try:
                names |= set(inspect.signature(init).parameters)
            except (TypeError, ValueError):
                continue
    return names


def _leaves(value: Any, path: str, out: dict[str, torch.Tensor]) -> bool:
    """Add ``value``'s leaves under ``path``; False (nothing added) when it is not state."""
    if isinstance(value, bool | int | float | np.number | np.bool_) and not isinstance(value, str):
        number = value.item() if isinstance(value, np.generic) else value
        out[f"{path}/py"] = torch.tensor(number, dtype=torch.float64 if isinstance(number, float) else None)
        return True
    if isinstance(value, np.ndarray) and value.dtype != object:
        out[f"{path}/np"] = torch.from_numpy(np.array(value, copy=True))
        return True
    if isinstance(value, torch.Tensor):
        out[f"{path}/pt"] = value.detach().cpu().clone()
        return True
    if isinstance(value, dict) and value:
        found: dict[str, torch.Tensor] = {}
        if all(_leaves(v, f"{path}/d:{quote(str(k), safe='')}", found) for k, v in value.items()):
            out.update(found)
            return True
        return False
    if isinstance(value, (list, tuple)) and value:
        found = {}
        if all(_leaves(v, f"{path}/l:{i}", found) for i, v in enumerate(value)):
            out.update(found)
            return True
    return False


def _state_of(obj: Any) -> dict[str, Any]:
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return {"state_dict": obj.state_dict()}
    settings = _settings(obj)
    return {k: v for k, v in vars(obj).items() if not k.startswith("_") and k not in settings | TRANSIENT}


def strategy_state(strategy: Strategy, prefix: str = "") -> dict[str, torch.Tensor]:
    """``{"<prefix><depth>/<attr>/.../<kind>": tensor}`` of the state of ``strategy`` and those it wraps."""
    out: dict[str, torch.Tensor] = {}
    for depth, inner in enumerate(_unwrap(strategy)):
        for attr, value in _state_of(inner).items():
            _leaves(value, f"{prefix}{depth}/{quote(attr, safe='')}", out)
    return out


def _legacy(name: str) -> str:
    """A name of the earlier layout (``<depth>/<attr>/dict|list/<key>``, numpy leaves) in this one."""
    depth, attr, kind, key = name.split("/", 3)
    return f"{depth}/{attr}/{'d' if kind == 'dict' else 'l'}:{quote(key, safe='')}/np"


def _build(node: dict[str, Any]) -> Any:
    """The value of a tree of ``{step: subtree | leaf}`` built from the names."""
    if "" in node:
        return node[""]
    if all(k.startswith("l:") for k in node):
        return [_build(node[f"l:{i}"]) for i in range(len(node))]
    return {unquote(k[2:]): _build(v) for k, v in node.items()}


def _leaf(tensor: torch.Tensor, kind: str) -> Any:
    if kind == "np":
        return tensor.numpy().copy()
    if kind == "pt":
        return tensor.clone()
    return tensor.item()


def load_strategy_state(strategy: Strategy, state: dict[str, torch.Tensor], prefix: str = "") -> None:
    """Set what :func:`strategy_state` saved (names of other prefixes and attributes it lacks are ignored)."""
    chain = _unwrap(strategy)
    trees: dict[tuple[int, str], dict[str, Any]] = {}
    for name, tensor in state.items():
        if not name.startswith(prefix):
            continue
        name = name[len(prefix):]
        parts = name.split("/")
        if not parts[0].isdigit():
            continue
        if len(parts) >= 4 and parts[2] in ("dict", "list"):
            parts = _legacy(name).split("/")
        if parts[-1] not in _KINDS or int(parts[0]) >= len(chain):
            continue
        node = trees.setdefault((int(parts[0]), unquote(parts[1])), {})
        for step in parts[2:-1]:
            node = node.setdefault(step, {})
        node[""] = _leaf(tensor, parts[-1])
    for (depth, attr), tree in trees.items():
        obj = chain[depth]
        if attr == "state_dict" and callable(getattr(obj, "load_state_dict", None)):
            obj.load_state_dict(_build(tree))
        elif hasattr(obj, attr):
            setattr(obj, attr, _build(tree))
