"""The Python blocks of README.md and docs/*.md, and running them as a reader would: a document's blocks in order,
in one namespace (so a later block sees what an earlier one defined), from a scratch folder of its own.

A block the tests cannot run is marked on the line before its fence with ``<!-- not-run: the reason -->`` (it
needs a GPU, several GPUs, a remote host); the tests list and count those.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(.*?)\s*-->\s*$")
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+.-]*)")

# Runs each document's blocks in order in a namespace of its own, from the document's own folder; a document whose
# block fails is reported (its traceback) and the next document runs. Results go to a JSON file.
_RUNNER = """
import json, os, sys, traceback
documents = json.load(open(sys.argv[1]))
results = {}
for doc, folder, blocks in documents:
    os.chdir(folder)
    namespace = {"__name__": "__main__"}
    results[doc] = {"ran": []}
    for label, code in blocks:
        print(f"--- {label}", flush=True)
        try:
            exec(compile(code, label, "exec"), namespace)
        except BaseException:
            results[doc]["error"] = traceback.format_exc()
            break
        results[doc]["ran"].append(label)
json.dump(results, open(sys.argv[2], "w"))
"""


@dataclass(frozen=True)
class Block:
    """One fenced ``python`` block of a document."""

    doc: str  # path relative to the repository
    line: int  # line of the block's first code line
    code: str
    not_run: str | None  # the documented reason the tests do not run it

    @property
    def label(self) -> str:
        return f"{self.doc}:{self.line}"


def python_blocks(doc: Path) -> list[Block]:
    """The ``python`` blocks of ``doc``, in order."""
    lines = doc.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            marker = _NOT_RUN.match(lines[i - 1].strip()) if i else None
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            out.append(Block(str(doc.relative_to(ROOT)), i + 2, "\n".join(lines[i + 1:end]) + "\n",
                             None if marker is None else marker.group(1)))
            i = end
        i += 1
    return out


@dataclass(frozen=True)
class Fenced:
    """One fenced block of a document, of any language (``lang`` is "" for an untagged fence)."""

    doc: str  # path relative to the repository
    line: int  # line of the opening fence
    lang: str
    text: str
    not_run: str | None  # the reason on a ``<!-- not-run: ... -->`` line before the fence

    @property
    def label(self) -> str:
        return f"{self.doc}:{self.line}"


def fenced_blocks(doc: Path) -> list[Fenced]:
    """Every fenced block of ``doc``, in order (a fence closes at a line of the same fence characters)."""
    lines = doc.read_text().splitlines()
    out: list[Fenced] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match:
            fence = match.group(1)
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence)
                        and not lines[j].strip().strip(fence[0])), len(lines))
            marker = _NOT_RUN.match(lines[i - 1].strip()) if i else None
            out.append(Fenced(str(doc.relative_to(ROOT)), i + 1, match.group(2).lower(),
                              "\n".join(lines[i + 1:end]) + "\n", None if marker is None else marker.group(1)))
            i = end
        i += 1
    return out


def substitute(blocks: Sequence[Block], substitutions: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """``(label, code)`` of the blocks to run, each ``(old, new)`` substitution applied; every substitution must
    match somewhere (a stale one fails, so the test keeps up with the document)."""
    out = []
    used = {old: 0 for old, _ in substitutions}
    for block in blocks:
        if block.not_run is not None:
            continue
        code = block.code
        for old, new in substitutions:
            used[old] += code.count(old)
            code = code.replace(old, new)
        out.append((block.label, code))
    stale = [old for old, n in used.items() if n == 0]
    assert not stale, f"substitutions {stale} match no block of {blocks[0].doc if blocks else '?'}: update the test"
    return out


def run_documents(documents: Sequence[tuple[str, Path, Sequence[tuple[str, str]]]], workdir: Path,
                  timeout: float = 1200.0) -> tuple[dict[str, dict[str, Any]], subprocess.CompletedProcess[str]]:
    """Run each document's ``(label, code)`` blocks, in order, in one fresh interpreter that imports this checkout
    (paying the imports once): every document in a namespace of its own, from its own folder. Returns, by
    document, the labels of the blocks that ran and the traceback of the one that failed, and the process."""
    program, results = workdir / "documents.json", workdir / "results.json"
    program.write_text(json.dumps([(doc, str(folder), list(blocks)) for doc, folder, blocks in documents]))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", OMP_NUM_THREADS="1")
    env.pop("GRPC_VERBOSITY", None)  # as a user's shell has it
    process = subprocess.run([sys.executable, "-c", _RUNNER, str(program), str(results)], cwd=workdir, env=env,
                             capture_output=True, text=True, timeout=timeout)
    return (json.loads(results.read_text()) if results.exists() else {}), process
