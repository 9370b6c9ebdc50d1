"""What a run's checkpoints are made from, so that ``resume = true`` continues only the run that wrote them.

A checkpoint records its :class:`RunIdentity`: the Flower app, the model, the cuts, the strategy (the run
config's name and the class that ran it) and the settings that shape training, with a digest of them. A resume
whose identity differs is refused with a message naming each difference. Settings that do not change what is
trained (where the trunk listens, logging, limits, speed knobs, how many rounds to run in all) may change
between a crash and its resume.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitfed.config import RunConfig
from splitfed.errors import CheckpointMismatchError

log = logging.getLogger(__name__)

#: Run-config keys a resumed run may change: they do not change what the run trains.
OPERATIONAL = frozenset({
    "resume", "num-server-rounds", "output-dir", "tensorboard-dir", "log-level", "log-json", "metrics-port",
    "trunk-bind", "trunk-port", "trunk-advertise", "trunk-insecure", "trunk-allow-plaintext-remote", "tls-cert",
    "tls-key", "tls-root-ca", "tls-client-ca", "auth", "token-ttl", "trunk-timeout", "trunk-max-concurrent-rpcs",
    "trunk-batch-window-ms", "trunk-max-batch-tokens", "trunk-checkpointing", "trunk-replicas", "shared-memory",
    "trunk-shared-memory-mib", "micro-batches", "compile", "min-train-nodes", "accept-failures", "eval-batches",
    "fraction-evaluate", "bulk-connections", "bulk-port",
})

#: The key a checkpoint's metadata keeps the identity under.
META_KEY = "run"


@dataclass(frozen=True)
class RunIdentity:
    """What a run's checkpoints are made from.

    Args:
        app: the Flower app (its FAB id, ``publisher/name``); empty when unknown (the Python API).
        model, cuts: the model and the cuts the trunk is served at.
        strategy: the run config's ``strategy``, and the class that aggregates the client parts when known
            (``fedavg (ClippedFedAvg)``).
        settings: every run-config value that shapes training (all but :data:`OPERATIONAL`).
    """

    app: str
    model: str
    cuts: tuple[int, int]
    strategy: str
    settings: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, cfg: RunConfig, cuts: tuple[int, int], *, app: str = "", strategy_class: str = "") -> RunIdentity:
        """The identity of a run of ``cfg`` whose trunk is cut at ``cuts``."""
        settings = {k: v for k, v in cfg.to_mapping().items() if k not in OPERATIONAL}
        strategy = f"{cfg.strategy} ({strategy_class})" if strategy_class else cfg.strategy
        return cls(app, cfg.model, (int(cuts[0]), int(cuts[1])), strategy, settings)

    @property
    def digest(self) -> str:
        """sha256 of the settings (model, cuts and strategy among them), as recorded."""
        text = json.dumps({"model": self.model, "cuts": list(self.cuts), "settings": dict(self.settings)},
                          sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def to_meta(self) -> dict[str, Any]:
        """The identity as checkpoint metadata (JSON)."""
        return {"app": self.app, "model": self.model, "cuts": list(self.cuts), "strategy": self.strategy,
                "config-digest": self.digest, "settings": dict(self.settings)}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> RunIdentity | None:
        """The identity a checkpoint recorded, or None for a checkpoint written before identities were."""
        doc = meta.get(META_KEY)
        if not isinstance(doc, Mapping):
            return None
        a, b = doc.get("cuts", (0, 0))
        return cls(str(doc.get("app", "")), str(doc.get("model", "")), (int(a), int(b)), str(doc.get("strategy", "")),
                   dict(doc.get("settings", {})))

    def differences(self, saved: RunIdentity) -> list[str]:
        """What differs between this run and the one that wrote ``saved``, in words (empty: the same run)."""
        out = []
        if self.app and saved.app and self.app != saved.app:
            out.append(f"app {saved.app!r} there, {self.app!r} here")
        if self.model != saved.model:
            out.append(f"model {saved.model!r} there, {self.model!r} here")
        if tuple(self.cuts) != tuple(saved.cuts):
            out.append(f"cuts {saved.cuts[0]},{saved.cuts[1]} there, {self.cuts[0]},{self.cuts[1]} here")
        if _strategy_differs(self.strategy, saved.strategy):
            out.append(f"strategy {saved.strategy!r} there, {self.strategy!r} here")
        for key in sorted(set(self.settings) | set(saved.settings)):
            if key in ("model", "cuts", "strategy"):
                continue
            mine, theirs = self.settings.get(key, "<unset>"), saved.settings.get(key, "<unset>")
            if mine != theirs:
                out.append(f"{key} = {theirs!r} there, {mine!r} here")
        return out

    def check_resume(self, meta: Mapping[str, Any], folder: Path) -> None:
        """Refuse to resume this run from the checkpoint ``meta`` of ``folder`` when another run made it."""
        saved = RunIdentity.from_meta(meta)
        if saved is None:  # written before checkpoints recorded their run: only the model and cuts are known
            if meta.get("model") != self.model or tuple(meta.get("cuts", ())) != tuple(self.cuts):
                raise CheckpointMismatchError(
                    f"resume = true, but the checkpoint in {folder} is for model {meta.get('model')} cut at "
                    f"{meta.get('cuts')}, not {self.model} cut at {list(self.cuts)}; point output-dir at this run's "
                    "own folder, or set resume = false to start over")
            log.warning("the checkpoint in %s does not record the run that made it (it predates run records): "
                        "only its model and cuts were checked", folder)
            return
        diffs = self.differences(saved)
        if diffs:
            raise CheckpointMismatchError(
                f"resume = true, but the checkpoint in {folder} was made by another run: {'; '.join(diffs)}. "
                "Resume it with the settings it was made with, point output-dir at this run's own folder (a "
                "relative output-dir is taken from $SPLITFED_OUTPUT_ROOT, else the SuperLink's working "
                "directory), or set resume = false to start over in a folder of its own")


def _strategy_differs(mine: str, theirs: str) -> bool:
    """Strategies differ by run-config name, and by class where both runs recorded it."""
    name = lambda s: s.split(" (")[0]  # noqa: E731
    return name(mine) != name(theirs) or ("(" in mine and "(" in theirs and mine != theirs)


__all__ = ["META_KEY", "OPERATIONAL", "RunIdentity"]
