"""Benchmarks that draw the committed figures write them to ``outputs/`` unless told ``--out docs/img``: running
one as the README writes it leaves ``docs/img`` as committed."""

from __future__ import annotations

import hashlib
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from flower_harness import ROOT

IMG = ROOT / "docs" / "img"


@pytest.mark.parametrize("module", ["bench.mnist_curves", "bench.variants", "bench.llm_finetune"])
def test_figure_benchmarks_default_to_outputs(module: str) -> None:
    out = Path(importlib.import_module(module).build_parser().parse_args([]).out)
    assert out.parts[0] == "outputs" and not out.is_absolute()


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.slow
def test_mnist_curves_as_the_readme_writes_it_leaves_docs_img_alone(tmp_path: Path) -> None:
    """``python -m bench.mnist_curves`` from a scratch folder: the figure lands in its outputs/, docs/img is as
    committed (two real ``flwr run``s, in a Flower home of their own)."""
    from test_e2e_flwr import _env, _kill_tree_matching

    before = _digests(IMG)
    home = tmp_path / "flwr-home"
    home.mkdir()
    env = dict(_env(home), PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    try:
        result = subprocess.run([sys.executable, "-m", "bench.mnist_curves"], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=1800)
    finally:
        _kill_tree_matching(str(home))
        ray = home / "ray-tmpdir"
        if ray.exists():
            _kill_tree_matching(ray.read_text())
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "outputs" / "mnist_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "outputs" / "mnist_curves.json").exists()
    assert _digests(IMG) == before
