"""Bytes a served model needs on its device: estimated before loading, measured once loaded, and the budget.

:func:`estimate` builds the model's skeleton on the ``meta`` device (no weights
are read or allocated; a checkpoint's header is read to check that it is
there), cuts it, puts the LoRA adapters on the trunk, and counts the trunk's
weights plus, for its trainable parameters, the gradients (held during a step:
the estimate is the peak) and the optimizer's state (Adam and AdamW: two
moments; SGD: none, as served without momentum).
Saved forwards and inference sessions' KV caches are not in it: they have their
own bounds (the saved-state budget, ``SessionLimits.max_cache_bytes``).

:class:`MemoryBudget` holds ``--max-memory`` per device: a model whose estimate
does not fit next to the models already reserved is refused with
:class:`~splitfed.errors.ResourceExhaustedError` before anything is allocated.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from splitfed.errors import ConfigError, ResourceExhaustedError
from splitfed.serving.spec import ModelSpec, normalize_device

#: Optimizer state per trainable parameter, in parameter sizes.
_OPTIMIZER_STATE = {"sgd": 0, "adam": 2, "adamw": 2}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "tib": 1 << 40}


@dataclass(frozen=True)
class Estimate:
    """What a model is expected to hold on its device."""

    device: str
    weights: int
    trainable: int
    optimizer_state: int

    @property
    def total(self) -> int:
        """Weights, gradients and optimizer state together."""
        return self.weights + self.trainable + self.optimizer_state


def _tensor_bytes(t: torch.Tensor, as_float32: bool) -> int:
    itemsize = 4 if as_float32 and t.is_floating_point() else t.element_size()
    return t.numel() * itemsize


def estimate(spec: ModelSpec) -> Estimate:
    """The bytes ``spec`` will hold on its device, from its config alone (nothing materialized).

    Raises what loading it would raise for a source that is not there
    (:class:`~splitfed.errors.ModelLoadError`) or cuts that do not split it
    (:class:`~splitfed.errors.SplitError`).
    """
    from splitfed.models.parts import build_parts, lora_setup
    from splitfed.serving.build import run_config

    cfg = run_config(spec)
    with torch.device("meta"):  # thread-local: a skeleton without storage
        split = build_parts(cfg, ())  # no role materialized: pretrained weights stay unread
        trunk = split.trunk
        lora = lora_setup(cfg, split)
        if lora is not None:
            from splitfed.models.lora import apply_lora

            apply_lora(trunk, lora, seed=0)
    if spec.frozen:
        trunk.requires_grad_(False)
    seen: set[int] = set()
    weights = trainable = 0
    for p in trunk.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = _tensor_bytes(p, as_float32=True)  # pretrained weights load as float32
        weights += n
        trainable += n if p.requires_grad else 0
    persistent = set(trunk.state_dict(keep_vars=True))
    for name, b in trunk.named_buffers():
        if id(b) not in seen and name in persistent:
            seen.add(id(b))
            weights += _tensor_bytes(b, as_float32=False)
    state = 0 if spec.frozen else trainable * _OPTIMIZER_STATE[spec.optimizer]
    return Estimate(spec.device, weights, 0 if spec.frozen else trainable, state)


def held_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes a loaded trunk holds now, by device: weights, buffers, gradients and optimizer state."""
    out: dict[str, int] = {}
    seen: set[int] = set()

    def add(t: torch.Tensor | None) -> None:
        if t is None or id(t) in seen or t.is_meta:
            return
        seen.add(id(t))
        key = str(t.device) if t.device.type != "cuda" else f"cuda:{t.device.index or 0}"
        out[key] = out.get(key, 0) + t.numel() * t.element_size()

    for p in module.parameters():
        add(p)
        add(p.grad)
    for b in module.buffers():
        add(b)
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    add(value)
    return out


def parse_bytes(text: str) -> int:
    """``"8GiB"``, ``"512MiB"``, ``"2e9"``, ``"1500000000"`` as a number of bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?b|b)?\s*", text.lower())
    if match is None:
        raise ConfigError(f"a memory size must be a number with an optional unit (KiB, MiB, GiB, TiB, KB, MB, GB, "
                          f"TB), got {text!r}")
    value = float(match.group(1)) * _UNITS[match.group(2) or ""]
    if value < 1:
        raise ConfigError(f"a memory size must be at least one byte, got {text!r}")
    return int(value)


def parse_budget(items: Iterable[str]) -> dict[str, int]:
    """``--max-memory`` values: ``DEVICE=SIZE`` each (``cpu=8GiB``, ``cuda:0=20GiB``), or a bare ``SIZE`` for
    every device (key ``*``)."""
    out: dict[str, int] = {}
    for item in items:
        for part in (p for p in item.split(",") if p.strip()):
            device, sep, size = part.rpartition("=")
            key = normalize_device(device) if sep else "*"
            if key in out:
                raise ConfigError(f"--max-memory names {key if key != '*' else 'every device'} twice")
            out[key] = parse_bytes(size)
    return out


class MemoryBudget:
    """Bytes each device may give to models; models reserve their estimate while they load and are held.

    Args:
        limits: bytes by device (``cpu``, ``cuda:N``); ``*`` for every device not named. No entry: no limit.
    """

    def __init__(self, limits: Mapping[str, int] | None = None) -> None:
        self.limits = dict(limits or {})
        self._reserved: dict[str, tuple[str, int]] = {}  # model -> (device, bytes)
        self._lock = threading.Lock()

    def limit(self, device: str) -> int | None:
        """The budget of ``device`` (None: unlimited)."""
        return self.limits.get(device, self.limits.get("*"))

    def reserved(self, device: str) -> int:
        """Bytes reserved on ``device``."""
        with self._lock:
            return sum(n for d, n in self._reserved.values() if d == device)

    def reserve(self, model: str, est: Estimate) -> None:
        """Reserve ``est`` for ``model``, or raise :class:`ResourceExhaustedError` (nothing reserved)."""
        with self._lock:
            limit = self.limit(est.device)
            holders = {m: n for m, (d, n) in self._reserved.items() if d == est.device and m != model}
            used = sum(holders.values())
            if limit is not None and used + est.total > limit:
                held = ", ".join(f"{m} {n / 2**20:.1f} MiB" for m, n in sorted(holders.items())) or "none"
                raise ResourceExhaustedError(
                    f"model {model!r} needs about {est.total / 2**20:.1f} MiB on {est.device} (weights "
                    f"{est.weights / 2**20:.1f} MiB, gradients and optimizer state "
                    f"{(est.trainable + est.optimizer_state) / 2**20:.1f} MiB), but only "
                    f"{max(limit - used, 0) / 2**20:.1f} of the {limit / 2**20:.1f} MiB budget of {est.device} are "
                    f"free (held: {held}); unload a model, load this one with LoRA or frozen, or raise --max-memory")
            self._reserved[model] = (est.device, est.total)

    def release(self, model: str) -> None:
        """Give back what ``model`` reserved."""
        with self._lock:
            self._reserved.pop(model, None)
