"""One folder per run under ``output-dir``, and a ``latest`` pointer: no run overwrites another.

Layout::

    outputs/
      20261205-151203-run4711/    history.json, checkpoint, checkpoints/, model/, plots of one run
      20261205-160455-run4712/
      latest -> 20261205-160455-run4712   (a relative symlink; a text file holding the name where links fail)

Every fresh run makes a folder of its own (:func:`new_run_dir`) and points ``latest`` at it
(switched with one atomic rename). A resume names the run it continues (:func:`resolve_resume`):
``resume = "latest"`` (or ``true``) is the run ``latest`` points at, any other value is a path,
either a run folder or an output folder whose latest run is meant; the resumed run writes on
into that same folder, so its history goes on where it stopped, and ``latest`` points at it again.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

from splitfed.errors import CheckpointError

log = logging.getLogger(__name__)

LATEST = "latest"
HISTORY = "history.json"


def new_run_dir(output_dir: str | Path, run_id: str | int) -> Path:
    """Create ``<output_dir>/<YYYYmmdd-HHMMSS>-run<run_id>`` (a suffix where it exists) and point ``latest`` at it."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = f"{time.strftime('%Y%m%d-%H%M%S')}-run{run_id}"
    folder, n = out / base, 1
    while True:
        try:
            folder.mkdir()
            break
        except FileExistsError:
            n += 1
            folder = out / f"{base}-{n}"
    point_latest(out, folder)
    return folder


def point_latest(output_dir: str | Path, run_dir: str | Path) -> None:
    """Switch ``<output_dir>/latest`` to ``run_dir`` (a relative symlink, else a text file with its name)."""
    out, name = Path(output_dir), Path(run_dir).name
    tmp = out / f".{LATEST}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.symlink_to(name)
    except OSError:  # a file system without symlinks
        tmp.write_text(name + "\n")
    os.replace(tmp, out / LATEST)


def latest_run(output_dir: str | Path) -> Path | None:
    """The run folder ``latest`` points at in ``output_dir``, else the newest run folder there, else None."""
    out = Path(output_dir)
    pointer = out / LATEST
    if pointer.is_symlink() or pointer.is_dir():
        target = pointer.resolve()
        if target.is_dir():
            return target
    elif pointer.is_file():
        target = out / pointer.read_text().strip()
        if target.is_dir():
            return target
    runs = list_runs(out)
    return runs[-1] if runs else None


def list_runs(output_dir: str | Path) -> list[Path]:
    """The run folders of ``output_dir`` (each holds a history or a checkpoint), oldest first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    runs = [p for p in out.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith(".")
            and ((p / HISTORY).exists() or (p / "checkpoint").exists() or "-run" in p.name)]
    return sorted(runs, key=lambda p: p.name)


def is_run_dir(path: str | Path) -> bool:
    """Whether ``path`` is one run's folder (it holds a history or a checkpoint)."""
    p = Path(path)
    return (p / HISTORY).is_file() or (p / "checkpoint").exists()


def resolve_resume(output_dir: str | Path, resume: str) -> Path:
    """The run folder that ``resume`` names: ``latest`` (or ``true``) in ``output_dir``, else a path (relative ones
    are taken from ``output_dir``) to a run folder, or to an output folder whose latest run is meant.

    Raises:
        CheckpointError: no such run; the message lists the runs there are.
    """
    out = Path(output_dir)
    if resume.lower() in (LATEST, "true", "1", "yes"):
        found = latest_run(out)
        where = out
    else:
        path = Path(resume).expanduser()
        path = path if path.is_absolute() else out / path
        found = path if is_run_dir(path) else latest_run(path)
        where = path
    if found is None:
        runs = ", ".join(p.name for p in list_runs(out)) or "none"
        raise CheckpointError(f"resume = {resume!r}: {where} holds no run to continue (runs in {out}: {runs}); "
                              f"set resume to one of them (a path, or 'latest'), or resume = false to start anew")
    return found
