"""Checkpoints that survive crashes: write, fsync, then one atomic switch; resume falls back.

Layout in the output folder::

    checkpoints/round-000003-1a2b3c4d/   a complete checkpoint (files fsynced, then the folder)
    checkpoints/round-000004-5e6f7a8b/   the newest one
    checkpoint -> checkpoints/round-000004-5e6f7a8b   (a relative symlink)

:func:`write_checkpoint` writes a new folder under a temporary name
(``checkpoints/.tmp-<pid>-...``), fsyncs every file and the folder, renames it to
its final name, fsyncs ``checkpoints/``, and then switches the ``checkpoint``
symlink with one ``rename`` (atomic on POSIX) and fsyncs the output folder. A
crash at any step leaves the previous checkpoint in place and whole. Only then
are older checkpoints pruned (the previous one is kept as a fallback), and
temporary folders of dead processes removed.

:func:`read_checkpoint` tries the folder ``checkpoint`` points at, then every
other complete checkpoint, newest first; a checkpoint is complete when its
``state.json`` (written last) lists every file with its size and sha256.
Tensors go to safetensors, everything else to JSON: nothing is pickled.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from splitfed.errors import CheckpointError

log = logging.getLogger(__name__)

CURRENT = "checkpoint"
FOLDER = "checkpoints"
STATE = "state.json"
KEEP = 2  # the newest checkpoint and the previous one (a fallback)

#: Called with the name of each step of :func:`write_checkpoint` (tests crash the process there).
step_hook: Callable[[str], None] = lambda step: None


@dataclass
class Checkpoint:
    """One checkpoint: tensor groups (each a safetensors file) and a JSON document."""

    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    folder: Path | None = None  # where it was read from


# -- writing ---------------------------------------------------------------------------------
def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_checkpoint(output_dir: str | Path, server_round: int, checkpoint: Checkpoint) -> Path:
    """Write ``checkpoint`` for ``server_round`` and make it the current one; returns its folder."""
    from safetensors.torch import save_file

    out = Path(output_dir)
    root = out / FOLDER
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    _adopt_legacy_folder(out)
    name = f"round-{server_round:06d}-{uuid.uuid4().hex[:8]}"
    tmp = root / f".tmp-{os.getpid()}-{name}"
    tmp.mkdir()
    files: dict[str, dict[str, Any]] = {}
    for group, tensors in checkpoint.tensors.items():
        path = tmp / f"{group}.safetensors"
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))
        _fsync_file(path)
        files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    step_hook("files-written")
    meta = {**checkpoint.meta, "round": server_round, "files": files}
    state = tmp / STATE
    state.write_text(json.dumps(meta, indent=1))
    _fsync_file(state)
    _fsync_dir(tmp)
    step_hook("folder-synced")
    final = root / name
    tmp.rename(final)
    _fsync_dir(root)
    step_hook("folder-renamed")
    link = out / f".{CURRENT}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    link.symlink_to(Path(FOLDER) / name)
    step_hook("link-made")
    os.replace(link, out / CURRENT)  # the switch: one atomic rename
    _fsync_dir(out)
    step_hook("switched")
    _prune(out, name, server_round)
    return final


def _adopt_legacy_folder(out: Path) -> None:
    """A ``checkpoint`` that is a plain folder (written before the symlink layout) moves under ``checkpoints/``."""
    current = out / CURRENT
    if current.is_dir() and not current.is_symlink():
        target = out / FOLDER / f"round-legacy-{uuid.uuid4().hex[:8]}"
        current.rename(target)
        _fsync_dir(out)
        log.warning("moved the checkpoint folder %s to %s (checkpoints are now switched by a symlink)", current,
                    target)


def remove_stale_temporaries(output_dir: str | Path) -> list[Path]:
    """Remove temporary checkpoint folders and links left by processes that are gone; returns them."""
    out = Path(output_dir)
    candidates = set((out / FOLDER).glob(".tmp-*")) if (out / FOLDER).is_dir() else set()
    candidates |= set(out.glob(f".{CURRENT}-*"))  # switch links, and the temp folders of older versions
    removed = []
    for path in sorted(candidates):
        pid = _pid_of(path.name)
        if pid is not None and pid != os.getpid() and _alive(pid):
            continue  # another live process is writing it (this process's own leftovers are stale)
        if path.is_symlink() or path.is_file():
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        log.warning("removed %d temporary checkpoint folder(s) of crashed processes in %s", len(removed), out)
    return removed


def _pid_of(name: str) -> int | None:
    for part in name.lstrip(".").split("-")[1:3]:
        if part.isdigit():
            return int(part)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _prune(out: Path, current: str, server_round: int) -> None:
    """Keep ``current`` and the newest :data:`KEEP` - 1 older checkpoints; remove the rest.

    Checkpoints of round ``server_round`` or later other than ``current`` belong to a run that was
    resumed from an earlier one (e.g. because they were damaged): they go first, so the fallback
    kept is the checkpoint this run's history really passed through.
    """
    others = [(r, folder) for r, folder in _candidates(out) if folder.name != current]
    older = [folder for r, folder in others if r < server_round]
    for folder in [folder for r, folder in others if r >= server_round] + older[KEEP - 1:]:
        shutil.rmtree(folder, ignore_errors=True)


# -- reading --------------------------------------------------------------------------------------
def _candidates(out: Path) -> list[tuple[int, Path]]:
    """Complete-looking checkpoint folders and their rounds, newest first."""
    root = out / FOLDER
    if not root.is_dir():
        return []
    found = []
    for folder in root.iterdir():
        if folder.name.startswith(".") or not (folder / STATE).is_file():
            continue
        try:
            meta = json.loads((folder / STATE).read_text())
            found.append((int(meta["round"]), (folder / STATE).stat().st_mtime_ns, folder))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return [(r, folder) for r, _, folder in sorted(found, key=lambda t: (t[0], t[1]), reverse=True)]


def _verify(folder: Path) -> dict[str, Any]:
    meta = json.loads((folder / STATE).read_text())
    for name, info in meta.get("files", {}).items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != info["bytes"] or _sha256(path) != info["sha256"]:
            raise CheckpointError(f"{path} is missing or does not match its recorded size and sha256")
    return meta


def read_checkpoint(output_dir: str | Path, accept: Callable[[dict[str, Any]], None] | None = None
                    ) -> Checkpoint:
    """The newest usable checkpoint of ``output_dir``: the current one, else the previous ones.

    ``accept(meta)`` may raise to refuse a checkpoint that belongs to another run (that error
    propagates). Raises :class:`CheckpointError` naming the folder when none is usable.
    """
    from safetensors.torch import load_file

    out = Path(output_dir)
    order: list[Path] = []
    current = out / CURRENT
    if current.exists():
        order.append(current.resolve())
    order += [folder for _, folder in _candidates(out) if folder.resolve() not in order]
    problems = []
    for folder in order:
        try:
            meta = _verify(folder)
            if accept is not None:
                accept(meta)
            tensors = {name[: -len(".safetensors")]: load_file(str(folder / name)) for name in meta["files"]}
        except (OSError, ValueError, KeyError, TypeError, CheckpointError) as exc:
            problems.append(f"{folder.name}: {exc}")
            log.warning("skipping checkpoint %s: %s", folder, exc)
            continue
        if problems:
            log.warning("resuming from the older checkpoint %s (round %s)", folder, meta.get("round"))
        return Checkpoint(tensors, meta, folder)
    looked = "; ".join(problems) if problems else "none found"
    raise CheckpointError(f"{out} holds no usable checkpoint to resume from ({looked}); set resume to the "
                          "folder of the run to continue (a path, or 'latest' in output-dir), or resume = false to "
                          "start a new run")


# -- nested state <-> tensors + JSON -----------------------------------------------------------------
def flatten(state: Any, tensors: dict[str, torch.Tensor], prefix: str = "") -> Any:
    """``state`` as JSON, each tensor replaced by ``{"tensor": key}`` and stored in ``tensors``."""
    if isinstance(state, torch.Tensor):
        key = prefix or "value"
        tensors[key] = state
        return {"tensor": key}
    if isinstance(state, Mapping):
        return {"dict": [[k, flatten(v, tensors, f"{prefix}.{k}" if prefix else str(k))] for k, v in state.items()]}
    if isinstance(state, (list, tuple)):
        return {"list": [flatten(v, tensors, f"{prefix}.{i}" if prefix else str(i)) for i, v in enumerate(state)],
                "tuple": isinstance(state, tuple)}
    if state is None or isinstance(state, (bool, int, float, str)):
        return {"value": state}
    raise CheckpointError(f"cannot store a {type(state).__name__} in a checkpoint (tensors, numbers, strings, "
                          "lists and dicts only)")


def unflatten(doc: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The inverse of :func:`flatten`."""
    if "tensor" in doc:
        return tensors[doc["tensor"]]
    if "dict" in doc:
        return {k: unflatten(v, tensors) for k, v in doc["dict"]}
    if "list" in doc:
        items = [unflatten(v, tensors) for v in doc["list"]]
        return tuple(items) if doc.get("tuple") else items
    return doc["value"]
