"""Installed, splitfed adds one top-level name: the wheel holds ``splitfed`` alone, with the Flower glue as
``splitfed.strategies`` and ``splitfed.apps``; a user's app with its own ``strategies/`` keeps it; and the
repository's Flower app still loads ``apps.server_app:app`` from its own folders."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    source = tmp_path_factory.mktemp("source")  # a copy: the build leaves build/ and *.egg-info behind it
    for name in ("splitfed", "strategies", "apps"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(source)], check=True, capture_output=True, timeout=300)
    (built,) = out.glob("splitfed-*.whl")
    return built


def test_the_wheel_installs_one_top_level_name(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"splitfed", wheel.name.split("-py3")[0] + ".dist-info"}
    for glue in ("splitfed/strategies/splitfed.py", "splitfed/strategies/run.py", "splitfed/apps/server_app.py",
                 "splitfed/apps/client_app.py", "splitfed/channel/wire/split_channel_pb2.pyi"):
        assert glue in names, glue


def test_a_fresh_venv_beside_a_users_own_strategies_folder(wheel: Path, tmp_path: Path) -> None:
    """A fresh venv with the wheel (its dependencies seen through this environment's site-packages, never this
    checkout), run from a user's app that has a ``strategies/`` package of its own."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of this checkout
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True, timeout=300, env=env)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # A path in a .pth file joins sys.path without its own .pth files being read: this checkout's editable
    # install stays out, the dependencies (torch, flwr, ...) come in.
    (Path(site) / "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    app = tmp_path / "userapp"
    (app / "strategies").mkdir(parents=True)
    (app / "strategies" / "__init__.py").write_text('MARK = "mine"\n')
    check = ("import strategies, splitfed\n"
             "from splitfed.strategies import SplitFed, build_strategy\n"
             "import splitfed.apps.server_app as server_app, splitfed.apps.client_app as client_app\n"
             "from flwr.serverapp import ServerApp\nfrom flwr.clientapp import ClientApp\n"
             "assert strategies.MARK == 'mine', strategies.__file__\n"
             "assert splitfed.__file__.startswith(sys.argv[1]), splitfed.__file__\n"
             "assert server_app.build_strategy is build_strategy\n"
             "assert isinstance(server_app.app, ServerApp) and isinstance(client_app.app, ClientApp)\n"
             "print(SplitFed.__module__)\n")
    result = subprocess.run([str(python), "-c", "import sys\n" + check, site], cwd=app, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["splitfed.strategies.splitfed"]
    cli = subprocess.run([str(venv / "bin" / "splitfed"), "--help"], cwd=app, env=env, capture_output=True, text=True,
                         timeout=300)
    assert cli.returncode == 0 and "serve" in cli.stdout, cli.stderr[-3000:]


def test_the_repositorys_flower_app_loads_from_its_folders() -> None:
    """What `flwr run .` does with pyproject's components: Flower's own check and load, from the project folder."""
    check = ("import sys\nfrom flwr.supercore.object_ref import load_app, validate\n"
             "for ref in ('apps.server_app:app', 'apps.client_app:app'):\n"
             "    ok, why = validate(ref, project_dir=sys.argv[1])\n"
             "    assert ok, why\n"
             "    app = load_app(ref, ValueError, project_dir=sys.argv[1])\n"
             "    print(type(app).__name__, sys.modules[ref.split(':')[0]].__package__)\n"
             "print('strategies' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", check, str(ROOT)], cwd="/", capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["ServerApp", "apps", "ClientApp", "apps", "True"]
