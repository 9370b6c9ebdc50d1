"""The researcher's examples (examples/*.py): their cores do what docs/research.md says (CI); they run as scripts,
and the custom strategy's ServerApp serves a real run (slow)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from flower_harness import ROOT, SUPERLINK_NODE, ThreadGrid, default_run_config, run_folder

EXAMPLES = ROOT / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_every_example_runs_as_a_script() -> None:
    # The scripts among them (an app module such as own_server_app.py runs under flwr: test_own_server_app.py).
    scripts = [p for p in sorted(EXAMPLES.glob("*.py")) if '__name__ == "__main__"' in p.read_text()]
    assert len(scripts) >= 3, scripts
    for path in scripts:
        result = subprocess.run([sys.executable, str(path)], cwd="/", capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{path.name}:\n{result.stderr[-2000:]}"
        assert result.stdout.strip(), path.name


def test_median_aggregator_resists_an_outlier_that_moves_the_mean() -> None:
    moved = _load("trunk_aggregator").main()
    assert moved["median-sync"] < 2 * moved["median-sync, no outlier"] < moved["sync (mean)"] / 5


def test_clipped_fedavg_bounds_the_update() -> None:
    moved = _load("custom_strategy").main()
    assert moved["clipped-fedavg"] <= 1.0 + 1e-6 < moved["fedavg"]


@pytest.mark.slow
def test_custom_strategy_serves_a_real_run_with_per_client_trunk_copies(tmp_path) -> None:
    """The example's ServerApp (its strategy on the client parts and on the trunk copies), in one process."""
    from flwr.app import Context, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from apps.client_app import app as client_app

    example = _load("custom_strategy")
    out = tmp_path / "outputs"
    config = default_run_config(output_dir=str(out), num_server_rounds=1, local_steps=2, trunk_mode="per-client")
    grid = ThreadGrid(client_app, 2, config, concurrency=2)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = grid.run_id, SUPERLINK_NODE, 1
    try:
        example.app(grid, Context(run_id=grid.run_id, node_id=SUPERLINK_NODE, node_config={}, state=RecordDict(),
                                  run_config=config))
    finally:
        grid.close()
    (record,) = json.loads((run_folder(out) / "history.json").read_text())["rounds"]
    assert record["trunk"]["trunk-copies"] == 2 and record["trunk"]["trunk-copies-freed"] == 2


def test_cut_policy_gives_small_nodes_a_shallow_bottom_and_a_valid_plan() -> None:
    from splitfed.config import parse_client_cuts

    result = _load("cut_policy").main()
    cuts = [n["cuts"] for n in result["nodes"]]
    assert cuts == ["3,6", "1,6", "3,6", "1,6"]
    plan = parse_client_cuts(result["client-cuts"])
    assert min(a for a, _ in plan) == 1 and max(b for _, b in plan) == 6  # the trunk holds every cut's blocks


def test_cut_policy_cuts_are_the_ones_a_client_trains_with() -> None:
    hetero = pytest.importorskip("splitfed.models.hetero", reason="heterogeneous cuts (client-cuts) are not on this branch")
    from splitfed.config import RunConfig

    example = _load("cut_policy")
    cfg = RunConfig.from_mapping(default_run_config(client_cuts=example.POLICY.client_cuts()))
    for memory, expected in ((16.0, (3, 6)), (1.0, (1, 6))):
        node = example.POLICY.node_config({"partition-id": 0, "num-partitions": 2, "memory-gb": memory})
        assert hetero.node_cut(cfg, 0, node) == expected


@pytest.mark.slow
def test_cut_policy_client_app_trains_each_node_at_its_own_depth(tmp_path) -> None:
    """The example's ClientApp in a real run with client-cuts: a small node trains with the shallow cut."""
    pytest.importorskip("splitfed.models.hetero", reason="heterogeneous cuts (client-cuts) are not on this branch")
    from flwr.app import Context, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from apps.server_app import app as server_app

    example = _load("cut_policy")
    out = tmp_path / "outputs"
    config = default_run_config(output_dir=str(out), num_server_rounds=1, local_steps=2,
                                client_cuts=example.POLICY.client_cuts())
    grid = ThreadGrid(example.app, 2, config, concurrency=2)
    for context, memory in zip(grid.contexts.values(), (16.0, 1.0)):
        context.node_config["memory-gb"] = memory
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = grid.run_id, SUPERLINK_NODE, 1
    try:
        server_app(grid, Context(run_id=grid.run_id, node_id=SUPERLINK_NODE, node_config={}, state=RecordDict(),
                                 run_config=config))
    finally:
        grid.close()
    assert [c.node_config["cuts"] for c in grid.contexts.values()] == ["3,6", "1,6"]
    (record,) = json.loads((run_folder(out) / "history.json").read_text())["rounds"]
    assert record["train"]["train-steps"] == 4 and record["evaluate"]["num-examples"] > 0


def _research_components() -> dict[str, str]:
    """The ``serverapp = ...`` / ``clientapp = ...`` recipes of docs/research.md."""
    text = (ROOT / "docs" / "research.md").read_text()
    found = dict(re.findall(r'`(serverapp|clientapp) = "([\w.]+:\w+)"`', text))
    assert set(found) == {"serverapp", "clientapp"}, found
    return found


def test_the_research_guides_flower_components_resolve_as_flower_resolves_them() -> None:
    """What `flwr run` does with ``serverapp = "examples.custom_strategy:app"``: Flower's own check and load, in a
    fresh interpreter, with opacus' top-level ``examples`` package installed (as ``.[all]`` installs it)."""
    pytest.importorskip("opacus")
    refs = list(_research_components().values())
    check = ("import sys\nfrom flwr.supercore.object_ref import load_app, validate\n"
             "for ref in sys.argv[2:]:\n"
             "    ok, why = validate(ref, project_dir=sys.argv[1])\n"
             "    assert ok, why\n"
             "    print(ref, type(load_app(ref, ValueError, project_dir=sys.argv[1])).__name__)\n")
    result = subprocess.run([sys.executable, "-c", check, str(ROOT), *refs], cwd="/", capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [refs[0], "ServerApp", refs[1], "ClientApp"]


@pytest.mark.slow
def test_the_research_guides_recipes_run_through_flwr_run(tmp_path: Path) -> None:
    """docs/research.md's recipes as a user applies them to the project's pyproject: the example ServerApp
    (its strategy) and the example ClientApp (the cut policy) in one `flwr run . local` with client-cuts."""
    from test_e2e_flwr import _env, _kill_tree_matching, _run_id, _status, flwr_run

    project = tmp_path / "project"
    for name in ("splitfed", "strategies", "apps", "examples"):
        shutil.copytree(ROOT / name, project / name, ignore=shutil.ignore_patterns("__pycache__"))
    components = _research_components()
    text = (ROOT / "pyproject.toml").read_text()
    text = text.replace('serverapp = "apps.server_app:app"', f'serverapp = "{components["serverapp"]}"')
    text = text.replace('clientapp = "apps.client_app:app"', f'clientapp = "{components["clientapp"]}"')
    text = text.replace('"apps/*.py"]', '"apps/*.py", "examples/*.py"]')  # as the guide says
    assert text.count("examples") == 3
    (project / "pyproject.toml").write_text(text)
    home = tmp_path / "flwr-home"
    home.mkdir()
    out = tmp_path / "outputs"
    try:
        env = _env(home)
        output = flwr_run([str(project), "local", "--stream", "--run-config",
                           f"num-server-rounds=1 local-steps=3 client-cuts='3,6 1,6' output-dir='{out}'",
                           "--federation-config", "num-supernodes=2 client-resources-num-cpus=1"], env)
        assert _status("local", _run_id(output), env) == "finished:completed", output[-4000:]
    finally:
        _kill_tree_matching(str(home))
        ray = home / "ray-tmpdir"
        if ray.exists():
            _kill_tree_matching(ray.read_text())
    (record,) = json.loads((run_folder(out) / "history.json").read_text())["rounds"]
    # Simulated nodes report no memory-gb: the policy gives them the shallow cut (1, 6), whose activations
    # (32 x 28 x 28 per image) are 4x the shared cut's: evaluation alone sends more than the shared cut could.
    assert record["evaluate"]["eval-bytes-sent"] > 2 * 1000 * 32 * 14 * 14 * 4
