"""The Python blocks of README.md and docs/*.md, and running them as a reader would: a document's blocks in order,
in one fresh Python process (so a later block sees what an earlier one defined), from a scratch folder.

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

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(.*?)\s*-->\s*$")

# Runs each block in one namespace; a block's frames are named after its document and line.
_RUNNER = """
import json, sys
namespace = {"__name__": "__main__"}
for label, code in json.load(open(sys.argv[1])):
    print(f"--- {label}", flush=True)
    exec(compile(code, label, "exec"), namespace)
print("--- all blocks ran", flush=True)
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


def run_blocks(blocks: Sequence[tuple[str, str]], workdir: Path, timeout: float = 600.0
               ) -> subprocess.CompletedProcess[str]:
    """Run ``(label, code)`` blocks in order in one fresh interpreter whose working directory is ``workdir`` and
    which imports this checkout."""
    program = workdir / "blocks.json"
    program.write_text(json.dumps(list(blocks)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", _RUNNER, str(program)], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=timeout)
