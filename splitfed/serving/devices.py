"""Whether this machine has the devices a model or a memory budget names, checked before anything loads.

A model placed on ``cuda:N`` where torch sees no GPU (a CPU-only build, no driver, ``CUDA_VISIBLE_DEVICES``
empty) or fewer than ``N + 1`` GPUs would fail deep in its build with torch's own error (a bare
``AssertionError: Torch not compiled with CUDA enabled``); a ``--max-memory cuda:N=...`` budget for such a
device would be accepted and bound nothing. Both are refused here with :class:`~splitfed.errors.ConfigError`.
"""

from __future__ import annotations

from collections.abc import Iterable

from splitfed.errors import ConfigError
from splitfed.serving.spec import ModelSpec, normalize_device


def gpu_count() -> int:
    """GPUs torch can use in this process (0 without a CUDA build, a driver or a visible device)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def missing_device(device: str) -> str | None:
    """Why ``device`` (``cpu``, ``cuda``, ``cuda:N``) cannot be used on this machine, or None when it can."""
    device = normalize_device(device)
    if device == "cpu":
        return None
    index, count = int(device.split(":")[1]), gpu_count()
    if count == 0:
        import torch

        why = "torch here is built without CUDA" if torch.version.cuda is None else "torch sees no GPU"
        return f"this machine has no CUDA device ({why}, torch {torch.__version__})"
    if index >= count:
        return f"this machine has {count} CUDA device{'s' if count > 1 else ''} (cuda:0..cuda:{count - 1})"
    return None


def check_spec_devices(specs: Iterable[ModelSpec]) -> None:
    """ConfigError naming the first model whose device this machine lacks."""
    for spec in specs:
        why = missing_device(spec.device)
        if why is not None:
            raise ConfigError(f"model {spec.name!r} is to load on {spec.device}, but {why}: load it on cpu (--device "
                              "cpu, or device = \"cpu\" in the models file) or on a server with that GPU")


def check_budget_devices(budget: Iterable[str]) -> None:
    """ConfigError for a ``--max-memory`` device (a key of the budget; ``*`` is every device) this machine lacks."""
    for device in budget:
        if device == "*":
            continue
        why = missing_device(device)
        if why is not None:
            raise ConfigError(f"--max-memory names {device}, but {why}: budget only devices this machine has "
                              "(cpu=SIZE), or one SIZE for every device")
