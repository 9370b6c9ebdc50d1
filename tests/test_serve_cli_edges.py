"""``splitfed serve`` and ``splitfed models`` at their edges: a GPU this machine lacks, a memory budget too small
for one of the models at start-up, and what an UNAVAILABLE call is told."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from splitfed.channel.admin.client import AdminClient
from splitfed.channel.client.trunk import TrunkClient
from splitfed.channel.wire.retry import RetryPolicy
from splitfed.channel.server.trunkserver import TrunkServer
from splitfed.channel.server.units import ModelState
from splitfed.cli.main import main
from splitfed.errors import ChannelError, ResourceExhaustedError
from splitfed.serving.memory import estimate
from splitfed.serving.spec import ModelSpec

pytestmark = pytest.mark.usefixtures("one_thread")

TOKEN = "admin-" + "z" * 26
#: A GPU this machine does not have: cuda:0 without CUDA, else one past the last.
MISSING_GPU = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
FAST = RetryPolicy(max_attempts=2, initial_backoff_s=0.05, max_backoff_s=0.05, timeout_s=20)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_line(capsys: pytest.CaptureFixture[str], command: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"splitfed {command}: error: "), err
    return lines[0]


@pytest.fixture
def server():
    server = TrunkServer(models=[ModelSpec("mnist-cnn", name="cnn", cuts=(3, 6))], insecure=True,
                         admin_token=TOKEN).start()
    yield server
    server.stop(grace=0)


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "admin.token"
    path.write_text(TOKEN)
    return path


@pytest.fixture
def nothing_built(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the models whose estimate or build started (nothing may, for a refused device)."""
    from splitfed.channel.server import registry

    started: list[str] = []
    real_estimate, real_build = registry.estimate, registry.unit_from_spec
    monkeypatch.setattr(registry, "estimate", lambda spec: started.append(spec.name) or real_estimate(spec))
    monkeypatch.setattr(registry, "unit_from_spec", lambda spec, *a: started.append(spec.name) or real_build(spec, *a))
    return started


# -- a GPU this machine lacks ----------------------------------------------------------------------
def test_models_load_on_a_missing_gpu_is_one_line_and_leaves_nothing(server, token_file: Path, capsys,
                                                                      nothing_built: list[str]) -> None:
    assert main(["models", "load", "mnist-cnn", "--name", "gpu", "--cuts", "3,6", "--device", MISSING_GPU,
                 "--server", server.address, "--admin-token-file", str(token_file)]) == 1
    line = _one_line(capsys, "models")
    assert "INVALID_ARGUMENT" in line and f"model 'gpu' is to load on {MISSING_GPU}, but this machine has" in line
    assert "AssertionError" not in line
    assert nothing_built == [] and server.models() == {"cnn": ModelState.READY}  # no FAILED entry left behind


def test_reload_onto_a_missing_gpu_is_refused_before_unloading(server) -> None:
    with AdminClient(server.address, TOKEN, insecure=True) as admin, pytest.raises(ChannelError) as info:
        admin.reload("cnn", ModelSpec("mnist-cnn", name="cnn", cuts=(3, 6), device=MISSING_GPU))
    assert info.value.code == "INVALID_ARGUMENT" and MISSING_GPU in str(info.value)
    assert server.models() == {"cnn": ModelState.READY} and server.unit("cnn").runtime.version == 0


@pytest.mark.parametrize("how", ["device", "models-file", "max-memory"])
def test_serve_on_a_missing_gpu_is_one_line_before_anything_loads(how: str, tmp_path: Path, capsys,
                                                                   nothing_built: list[str]) -> None:
    argv = ["serve", "--insecure", "--port", "0"]
    if how == "device":
        argv += ["--model", "mnist-cnn", "--device", MISSING_GPU]
    elif how == "models-file":
        models = tmp_path / "models.toml"
        models.write_text(f'[models.cnn]\nmodel = "mnist-cnn"\n\n[models.gpu]\nmodel = "mnist-cnn"\n'
                          f'device = "{MISSING_GPU}"\n')
        argv += ["--models-file", str(models)]
    else:
        argv += ["--model", "mnist-cnn", "--max-memory", f"{MISSING_GPU}=1GiB"]
    assert main(argv) == 1
    line = _one_line(capsys, "serve")
    assert MISSING_GPU in line and "this machine has" in line and "AssertionError" not in line
    assert ("--max-memory names" in line) == (how == "max-memory")
    assert nothing_built == []


# -- a budget too small for one model at start-up --------------------------------------------------
def test_a_model_beyond_the_budget_at_start_is_refused_and_the_rest_serve(token_file: Path, capsys) -> None:
    both = estimate(ModelSpec("mnist-cnn", cuts=(3, 6))).total + estimate(ModelSpec("tiny-gpt2")).total
    server = TrunkServer(models=[ModelSpec("mnist-cnn", name="cnn", cuts=(3, 6)), ModelSpec("tiny-gpt2", name="big")],
                         insecure=True, admin_token=TOKEN, max_memory={"cpu": both - 1}).start()
    try:
        assert server.models() == {"big": ModelState.FAILED, "cnn": ModelState.READY}
        client = TrunkClient(server.address, insecure=True, model="cnn", retry=FAST)
        assert tuple(client.info().cuts) == (3, 6)  # the model that fits serves
        client.close()
        capsys.readouterr()
        assert main(["models", "list", "--server", server.address, "--admin-token-file", str(token_file)]) == 0
        out = capsys.readouterr().out
        assert any(line.split()[:2] == ["big", "FAILED"] for line in out.splitlines()), out
        assert "big: refused at start-up: model 'big' needs about" in out and "raise --max-memory" in out
        big = TrunkClient(server.address, insecure=True, model="big", retry=FAST)
        with pytest.raises(ChannelError) as info:
            big.info()
        big.close()
        assert info.value.code == "FAILED_PRECONDITION" and "refused at start-up" in str(info.value)
        with AdminClient(server.address, TOKEN, insecure=True) as admin:  # once room is made, a reload loads it
            admin.unload("cnn")
            admin.reload("big")
        assert server.models() == {"big": ModelState.READY}
    finally:
        server.stop(grace=0)


def test_start_fails_when_no_model_fits(capsys) -> None:
    with pytest.raises(ResourceExhaustedError, match="model 'big' needs about"):
        TrunkServer(models=[ModelSpec("tiny-gpt2", name="big")], insecure=True, max_memory={"cpu": 1 << 20}).start()
    assert main(["serve", "--model", "tiny-gpt2", "--max-memory", "cpu=1MiB", "--insecure", "--port", "0"]) == 1
    assert "model 'tiny-gpt2' needs about" in _one_line(capsys, "serve")


# -- UNAVAILABLE: no server, or a server that said why ---------------------------------------------
def test_a_model_loading_is_told_to_retry_not_to_start_a_server(server) -> None:
    server.registry.pending.add("late")  # as a model of the server's start is until its load begins
    client = TrunkClient(server.address, insecure=True, model="late", retry=FAST)
    with pytest.raises(ChannelError) as info:
        client.info()
    client.close()
    text = str(info.value)
    assert info.value.code == "UNAVAILABLE" and "model 'late' is loading; retry when" in text
    assert "is a trunk server running" not in text and "splitfed serve" not in text


def test_a_model_being_unloaded_is_told_so_not_to_start_a_server(server) -> None:
    server.registry.entries["cnn"].state = ModelState.UNLOADING  # as it is while its calls drain
    try:
        client = TrunkClient(server.address, insecure=True, model="cnn", retry=FAST)
        with pytest.raises(ChannelError) as info:
            client.info()
        client.close()
    finally:
        server.registry.entries["cnn"].state = ModelState.READY
    text = str(info.value)
    assert info.value.code == "UNAVAILABLE" and "model 'cnn' is being unloaded" in text
    assert "is a trunk server running" not in text


def test_no_server_at_the_address_gets_the_hint_to_start_one(token_file: Path, capsys) -> None:
    port = _free_port()
    client = TrunkClient(f"127.0.0.1:{port}", insecure=True, retry=FAST)
    with pytest.raises(ChannelError) as info:
        client.info()
    client.close()
    assert f"is a trunk server running at 127.0.0.1:{port}? Start one with `splitfed serve" in str(info.value)
    assert main(["models", "list", "--server", f"127.0.0.1:{port}", "--admin-token-file", str(token_file)]) == 1
    line = _one_line(capsys, "models")
    assert f"is a trunk server running at 127.0.0.1:{port}?" in line and "--admin-token-file" in line


# -- a model that needs code of its own ------------------------------------------------------------
def _custom_model(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        '{"model_type": "acmelm", "num_hidden_layers": 4, "auto_map": {"AutoConfig": "configuration_acme.AcmeConfig", '
        '"AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM"}}')
    return folder


def test_a_local_model_with_its_own_code_is_one_line_pointing_at_its_folder(tmp_path: Path, capsys,
                                                                             monkeypatch) -> None:
    import builtins

    prompts: list[str] = []
    monkeypatch.setattr(builtins, "input", lambda *a: prompts.append(str(a)) or "n")
    folder = _custom_model(tmp_path / "acme")
    assert main(["serve", "--model", str(folder), "--cuts", "1,2", "--insecure", "--port", "0"]) == 1
    line = _one_line(capsys, "serve")
    assert f"the model of {folder} needs code of its own to load (configuration_acme.py, modeling_acme.py)" in line
    assert f"the model's files: {folder.resolve()}" in line and "'acmelm'" in line
    assert "hf.co" not in line and "a bug?" not in line and "trust_remote_code=True" not in line
    assert prompts == []  # never asked on stdin whether to run the model's code


def test_a_hub_model_with_its_own_code_points_at_its_hub_page(tmp_path: Path, monkeypatch) -> None:
    import huggingface_hub

    from splitfed.models import llm
    from splitfed.errors import UnsupportedModelError

    snapshot = _custom_model(tmp_path / "hub" / "models--acme--custom-lm" / "snapshots" / "0123abc")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: str(snapshot))
    with pytest.raises(UnsupportedModelError) as info:
        llm.load_config("acme/custom-lm")
    text = str(info.value)
    assert text.endswith("the model's files: https://huggingface.co/acme/custom-lm") and "hf.co/" not in text


def test_tls_to_a_plaintext_server_is_told_the_handshake_failed_not_to_start_a_server(server) -> None:
    import grpc

    client = TrunkClient(server.address, credentials=grpc.ssl_channel_credentials(), retry=FAST)
    with pytest.raises(ChannelError) as info:
        client.info()
    client.close()
    text = str(info.value)
    assert f"a server answers at {server.address}, but the TLS handshake failed" in text
    assert "is a trunk server running" not in text
