"""`splitfed serve` with several models, `splitfed models ...` around the admin service, and the README's three
lines (with a local model instead of the hub)."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from test_serving import CNN_INPUT, save_llama

from splitfed.channel.client.trunk import TrunkClient
from splitfed.channel.wire.limits import ChannelLimits
from splitfed.cli.main import main
from splitfed.split import CutState

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "cli-admin-token-" + "z" * 16


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("tiny-llama"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serving(address: str, *models: str, timeout: float = 120.0) -> None:
    """Wait until each of ``models`` is SERVING in the server's gRPC health (as a deployment's probe would)."""
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from splitfed.channel.server.health import health_name

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        for model in models:
            while True:
                try:
                    status = check(health_pb2.HealthCheckRequest(service=health_name(model)), timeout=5).status
                except grpc.RpcError:
                    status = None  # not serving yet, or the model not announced yet
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
                assert time.monotonic() < deadline, f"model {model!r} not SERVING within {timeout}s"
                time.sleep(0.1)


def _models(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["models", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_serve_several_models_and_manage_them_from_the_command_line(tmp_path: Path, llama_dir: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    token_file = tmp_path / "admin-token"
    token_file.write_text(TOKEN + "\n")
    models_file = tmp_path / "models.toml"
    models_file.write_text(f'[models.llm]\nmodel = "{llama_dir}"\ncuts = "1,3"\nlora-rank = 4\n'
                           'optimizer = "adamw"\ntrunk-mode = "async"\n')
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "splitfed.cli", "serve", "--model", "cnn=mnist-cnn:3,6",
                             "--models-file", str(models_file), "--admin-token-file", str(token_file),
                             "--port", str(port), "--insecure", "--bulk-connections", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    address = f"127.0.0.1:{port}"
    admin = ["--server", address, "--admin-token-file", str(token_file), "--json"]
    try:
        # The CNN's client streams its tensors over a bulk link (a low stream threshold: they are small).
        with TrunkClient(address, insecure=True, model="cnn", shared_memory="off", bulk_connections=2,
                         limits=ChannelLimits(stream_threshold_bytes=1 << 10)) as cnn, \
                TrunkClient(address, insecure=True, model="llm") as llm:
            _serving(address, "llm", "cnn")  # the server serves while it loads them, one after the other
            assert list(cnn.info().cuts) == [3, 6]
            assert (llm.info().trunk_mode, list(llm.info().cuts)) == ("async", [1, 3])
            listed = {m["name"]: m for m in _models(capsys, "list", *admin)["models"]}
            assert {n: m["state"] for n, m in listed.items()} == {"cnn": "READY", "llm": "READY"}
            assert listed["llm"]["lora_rank"] == 4 and listed["llm"]["bytes"]["cpu"] > 0
            (loaded,) = _models(capsys, "load", "mnist-cnn", "--name", "cnn2", "--trunk-mode", "quorum",
                                *admin)["models"]
            assert (loaded["name"], loaded["state"], loaded["trunk_mode"]) == ("cnn2", "READY", "quorum")
            act = uuid.uuid4().hex
            out, _ = cnn.forward(CutState(torch.randn(*CNN_INPUT)), activation_id=act, train=True)
            assert cnn.backward(act, torch.ones_like(out)).trunk_version == 1
            assert cnn.bulk.calls == 2 and cnn.bulk.failed is None
            (reloaded,) = _models(capsys, "reload", "cnn", *admin)["models"]
            assert (reloaded["state"], reloaded["trunk_version"]) == ("READY", 0)
            (unloaded,) = _models(capsys, "unload", "cnn2", *admin)["models"]
            assert unloaded["state"] == "UNLOADED"
            assert sorted(m["name"] for m in _models(capsys, "list", *admin)["models"]) == ["cnn", "llm"]
            # The plain table too.
            assert main(["models", "list", "--server", address, "--admin-token-file", str(token_file)]) == 0
            table = capsys.readouterr().out
            assert re.search(r"^llm\s+READY\s+\S+\s+1,3\s+async\s+4\s+cpu", table, re.M), table
            # `splitfed generate` through one model of the server.
            assert main(["generate", "--model", str(llama_dir), "--cuts", "1,3", "--prompt", "Hi", "--max-new-tokens",
                         "4", "--trunk", address, "--insecure", "--trunk-model", "llm"]) == 0
            assert capsys.readouterr().out.strip()
            # Bad calls end the command (exit status 1) with one line: the status and its message.
            capsys.readouterr()
            assert main(["models", "load", str(tmp_path / "nowhere"), *admin]) == 1
            err = capsys.readouterr().err
            assert "splitfed models: error:" in err and "NOT_FOUND" in err and "does not exist" in err, err
            assert main(["models", "list", "--server", address, "--admin-token", "w" * 20]) == 1
            assert "PERMISSION_DENIED" in capsys.readouterr().err
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-3000:]


def test_serve_refuses_models_beyond_the_memory_budget() -> None:
    """The model that does not fit is refused, saying why; the one that fits serves (the server stays up)."""
    proc = subprocess.Popen([sys.executable, "-m", "splitfed.cli", "serve", "--model", "a=mnist-cnn",
                             "--model", "b=mnist-cnn", "--max-memory", "cpu=200KiB", "--port", "0", "--insecure"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = []
        for line in proc.stdout:
            out.append(line)
            if "splitfed: serving" in line or proc.poll() is not None:
                break
        text = "".join(out)
        assert "model 'b' needs about" in text and "held: a" in text, text[-2000:]
        assert "serving a on" in text and "(refused: b;" in text, text[-2000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


def test_readme_three_lines_generate_through_the_server(llama_dir: Path) -> None:
    """The README's snippet, as written, with a local model for the hub id and a free port."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Three lines"):]
    code = section[section.index("```python") + len("```python"):section.index("```", section.index("```python")
                                                                                + 9)]
    assert 'splitfed.serve("HuggingFaceTB/SmolLM2-135M", port=50051)' in code
    port = _free_port()
    code = code.replace("HuggingFaceTB/SmolLM2-135M", str(llama_dir)).replace("50051", str(port))
    printed: list[str] = []
    scope = {"print": lambda *args: printed.append(" ".join(map(str, args)))}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own snippet
    try:
        from splitfed.models.llm import load_model, load_tokenizer

        tok = load_tokenizer(str(llama_dir))
        ids = tok("The capital of France is", return_tensors="pt").input_ids
        want = load_model(str(llama_dir)).eval().generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                          max_new_tokens=8, pad_token_id=258, eos_token_id=257)
        assert printed == [tok.decode(want[0, ids.shape[1]:], skip_special_tokens=True)]
        assert printed[0]  # it did generate text
    finally:
        scope["lm"].close()
        scope["server"].stop(grace=0)


def test_models_file_and_model_flags_parse_to_specs(tmp_path: Path) -> None:
    from splitfed.cli.main import build_parser
    from splitfed.cli.models import spec_from_flag
    from splitfed.errors import ConfigError
    from splitfed.serving.spec import ModelSpec, read_models_file

    path = tmp_path / "models.toml"
    path.write_text('[models.a]\nmodel = "mnist-cnn"\ncuts = [3, 6]\ntrunk-mode = "quorum"\nquorum = 2\n'
                    '[models.b]\nmodel = "/m/llama"\nname = "chat"\nlora-rank = 8\ndevice = "cuda"\n')
    a, b = read_models_file(path)
    assert a == ModelSpec("mnist-cnn", name="a", cuts=(3, 6), trunk_mode="quorum", quorum=2)
    assert (b.name, b.model, b.lora_rank, b.device) == ("chat", "/m/llama", 8, "cuda:0")
    for text, words in (('[models.a]\nmodel = "x"\nlearning-rate = 1\n', "unknown key 'learning-rate'"),
                        ('[models.a]\ncuts = "3,6"\n', "has no model key"),
                        ('[models.a]\nmodel = "x"\ntrunk-mode = "fast"\n', "trunk-mode of model 'a'"),
                        ('[models.a]\nmodel = "x"\ncuts = "6,3"\n', "0 < a < b"),
                        ('[models.a]\nmodel = "x"\nname = "b"\n[models.b]\nmodel = "y"\n', "names a model twice"),
                        ('model = "x"\n', "unknown top-level keys"),
                        ('[models.a\n', "not valid TOML")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(words)):
            read_models_file(path)
    with pytest.raises(ConfigError, match="does not exist"):
        read_models_file(tmp_path / "none.toml")
    args = build_parser().parse_args(["serve", "--model", "x", "--cuts", "2,4", "--lora-rank", "4"])
    assert spec_from_flag("chat=/m/llama:3,27", args) == ModelSpec("/m/llama", name="chat", cuts=(3, 27), lora_rank=4,
                                                                  lora_optional=True)  # the server's default LoRA
    assert spec_from_flag("HuggingFaceTB/SmolLM2-135M", args).name == "HuggingFaceTB/SmolLM2-135M"
    assert spec_from_flag("mnist-cnn", args).cuts == (2, 4)  # --cuts for the models without their own
    with pytest.raises(ConfigError, match="printable characters without spaces"):
        ModelSpec("mnist-cnn", name="two words")
