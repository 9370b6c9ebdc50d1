"""Run-config messages name the key, the form it expects and, for a typo, the closest key there is; LoRA on the
CNN names the layers ``lora-targets`` may take, and trains them when given."""

from __future__ import annotations

import pytest
import torch

from splitfed.config import RunConfig, override_keys
from splitfed.errors import ConfigError
from splitfed.models.parts import build_parts

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(("values", "message"), [
    ({"cuts": "3-6"}, "run-config key 'cuts' = '3-6' is not valid: cuts must be two integers A,B"),
    ({"cuts": "3,4,5"}, "cuts must be two integers A,B"),
    ({"lr": "fast"}, "lr must be a number"),
    ({"quorum": 2.5}, "quorum must be an integer"),
    ({"num-server-round": 3}, "unknown run-config key 'num-server-round'; did you mean 'num-server-rounds'?"),
    ({"trunk-mod": "sync"}, "did you mean 'trunk-mode'?"),
])
def test_a_bad_value_or_key_is_named_with_what_is_expected(values: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        RunConfig.from_mapping(values)


@pytest.mark.parametrize(("value", "parsed"), [
    (True, "latest"), ("true", "latest"), ("latest", "latest"), (False, ""), ("false", ""), ("", ""),
    ("outputs/20261205-151203-run7", "outputs/20261205-151203-run7"),
])
def test_resume_is_latest_a_path_or_off(value: object, parsed: str) -> None:
    assert RunConfig.from_mapping({"resume": value}).resume == parsed


def test_a_resume_path_that_holds_no_run_names_the_runs_there_are(tmp_path) -> None:
    from splitfed.errors import CheckpointError
    from splitfed.run.rundirs import new_run_dir, resolve_resume

    run = new_run_dir(tmp_path, 7)
    (run / "history.json").write_text("{}")
    with pytest.raises(CheckpointError, match=f"holds no run to continue \\(runs in {tmp_path}: {run.name}\\)"):
        resolve_resume(tmp_path, "maybe")
    assert resolve_resume(tmp_path, "latest") == run
    assert resolve_resume(tmp_path, run.name) == run


def test_the_server_app_names_a_typo_in_the_apps_own_config(tmp_path) -> None:
    """A key in a pyproject that splitfed does not know (Flower accepts its own defaults) fails at start."""
    from flower_harness import run_apps

    with pytest.raises(ConfigError, match="'local-step'; did you mean 'local-steps'"):
        run_apps(tmp_path, num_nodes=2, local_step=3)


def test_bench_overrides_are_checked_before_any_run(capsys) -> None:
    from bench.variants import main

    assert override_keys("trunk-mode='quorum' quorum=3 client-cuts='1,6 4,9'") == [
        "trunk-mode", "quorum", "client-cuts"]
    with pytest.raises(SystemExit) as stopped:
        main(["--extra", "local-step=10", "--out", "/nonexistent/never-written"])
    assert stopped.value.code == 2 and "did you mean 'local-steps'" in capsys.readouterr().err


def test_lora_on_the_cnn_names_the_layers_lora_targets_may_take() -> None:
    for targets in ("", "conv", "1"):
        with pytest.raises(ConfigError) as caught:
            build_parts(RunConfig(lora_rank=4, lora_targets=targets))
        assert "0 (Conv2d), 3 (Conv2d), 7 (Linear), 9 (Linear)" in str(caught.value)
        assert "lora-targets" in str(caught.value)


def test_lora_on_the_cnn_trains_the_layers_it_names_and_only_their_adapters() -> None:
    parts = build_parts(RunConfig(lora_rank=4, lora_targets="3,7,9"))
    trainable = {role: [n for n, p in getattr(parts, role).named_parameters() if p.requires_grad]
                 for role in ("bottom", "trunk", "top")}
    # Layer 3 is the trunk's first conv, 7 and 9 the top's linear layers; the bottom (layer 0) stays frozen.
    assert trainable["bottom"] == []
    assert trainable["trunk"] and all("layers.0.lora_" in n for n in trainable["trunk"])
    assert {n.split(".lora_")[0] for n in trainable["top"]} == {"layers.1", "layers.3"}
    before = {k: v.clone() for k, v in parts.state_dict().items()}
    params = [p for p in parts.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.1)
    torch.manual_seed(0)
    for _ in range(3):
        optimizer.zero_grad()
        parts(torch.randn(8, 1, 28, 28), labels=torch.arange(8)).loss.backward()
        optimizer.step()
    after = parts.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all("lora_" in k for k in moved)
    assert any(k.startswith("trunk.") for k in moved) and any(k.startswith("top.") for k in moved)


@pytest.mark.slow
def test_flowers_code_15_names_the_key_in_the_superlink_log_the_readme_points_to(tmp_path) -> None:
    """README: a key pyproject does not define gets Flower's "[code: 15] Invalid run configuration"; the key is
    in $FLWR_HOME/local-superlink/superlink.log."""
    from test_e2e_flwr import _env, _kill_tree_matching, flwr_run

    home = tmp_path / "flwr-home"
    home.mkdir()
    try:
        output = flwr_run([".", "local", "--stream", "--run-config", "num-server-round=2"], _env(home))
    finally:
        _kill_tree_matching(str(home))
    assert "[code: 15]" in output and "Invalid run configuration" in output
    log = (home / "local-superlink" / "superlink.log").read_text()
    assert "Key 'num-server-round' is not present in the main dictionary" in log
