"""TensorBoard event files of every round's metrics (the ``tensorboard-dir`` run-config key).

Each round's numbers go in as scalars under ``train/``, ``evaluate/``, ``trunk/`` and
``failures/`` tags (``train/train-loss``, ``evaluate/eval-accuracy``, ...), plus
``round/seconds``, at step = the round number. ``tensorboard --logdir DIR`` shows them.
Needs the ``tensorboard`` package (``pip install 'splitfed[tensorboard]'``), imported only
when the key is set.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Protocol

from splitfed.extras import require

log = logging.getLogger(__name__)


class _Round(Protocol):
    round: int
    train: dict[str, float]
    evaluate: dict[str, float]
    trunk: dict[str, float]
    seconds: float
    failures: dict[str, Any]


class RoundWriter:
    """Writes each round's metrics with ``torch.utils.tensorboard.SummaryWriter`` (a no-op without a folder).

    Args:
        log_dir: where the event files go; None: write nothing.
    """

    def __init__(self, log_dir: str | Path | None) -> None:
        self.log_dir = Path(log_dir) if log_dir else None
        self._writer: Any = None
        if self.log_dir is not None:
            require("tensorboard", "tensorboard-dir (TensorBoard event files)")
            from torch.utils.tensorboard import SummaryWriter

            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(log_dir=str(self.log_dir))

    @classmethod
    def for_run(cls, tensorboard_dir: str, output_dir: str | Path) -> RoundWriter:
        """``tensorboard-dir`` of a run: empty is off; a relative path is taken inside ``output_dir``."""
        if not tensorboard_dir:
            return cls(None)
        path = Path(tensorboard_dir).expanduser()
        return cls(path if path.is_absolute() else Path(output_dir) / path)

    def write(self, record: _Round) -> None:
        """Add the round's scalars and flush them to disk."""
        if self._writer is None:
            return
        step = int(record.round)
        for section in ("train", "evaluate", "trunk"):
            for key, value in sorted(getattr(record, section).items()):
                self._scalar(f"{section}/{key}", value, step)
        for key, value in sorted(record.failures.items()):
            self._scalar(f"failures/{key}", value, step)
        self._scalar("round/seconds", record.seconds, step)
        self._writer.flush()

    def _scalar(self, tag: str, value: Any, step: int) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
            return
        self._writer.add_scalar(tag, float(value), step)

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
