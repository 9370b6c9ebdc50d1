"""LoRA per served model: each ``--model`` (and each models-file table) has its own rank, alpha and targets; the
``serve`` options are defaults, and default LoRA goes only to models with default LoRA targets. docs/serving.md's
several-models command runs as written (a small local Llama for its ``/models/smollm2``)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from doc_blocks import ROOT
from test_serving import save_llama

from splitfed.channel.server.trunkserver import TrunkServer
from splitfed.errors import ConfigError
from splitfed.serving.memory import estimate, parse_budget
from splitfed.serving.spec import ModelSpec, parse_model_flag, read_models_file

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("tiny-llama"))


def adapters(trunk) -> dict[str, tuple[int, float]]:
    """The trunk's LoRA-adapted modules: name -> (rank, scaling)."""
    return {name: (module.r["default"], module.scaling["default"]) for name, module in trunk.named_modules()
            if hasattr(module, "lora_A") and "default" in module.lora_A}


def trainable(trunk) -> set[str]:
    return {name for name, p in trunk.named_parameters() if p.requires_grad}


def _doc_command() -> list[str]:
    """The ``splitfed serve`` line of docs/serving.md's "Several models" block, as a shell splits it."""
    text = (ROOT / "docs" / "serving.md").read_text()
    block = text[text.index("## Several models"):].split("```bash", 1)[1].split("```", 1)[0]
    line = " ".join(part.rstrip("\\").strip() for part in block.splitlines() if part.strip()
                    and not part.startswith("python"))
    return shlex.split(line)


def test_the_documented_two_model_command_serves_each_model_with_its_own_lora(llama_dir: Path,
                                                                             tmp_path: Path) -> None:
    from splitfed.cli.main import build_parser
    from splitfed.cli.models import read_token, spec_from_flag

    argv = _doc_command()
    assert argv[:2] == ["splitfed", "serve"] and "--lora-rank" in argv
    argv = [a.replace("/models/smollm2:3,27", f"{llama_dir}:1,3") for a in argv[1:]]  # 4 blocks, not SmolLM2's 30
    argv[argv.index("--metrics-port") + 1] = "0"
    token = tmp_path / "admin.token"
    token.write_text("a" * 32)
    argv[argv.index("--admin-token-file") + 1] = str(token)
    args = build_parser().parse_args(argv)
    specs = [spec_from_flag(text, args) for text in args.model]
    assert [(s.name, s.lora_rank, s.lora_targets, s.lora_optional) for s in specs] == [
        ("digits", 8, (), True), ("chat", 8, ("q_proj", "v_proj"), False)]
    server = TrunkServer(models=specs, insecure=True, port=0, admin_token=read_token(args),
                         max_memory=parse_budget(args.max_memory)).start()
    try:
        assert {n: s.value for n, s in server.models().items()} == {"digits": "READY", "chat": "READY"}
        chat, digits = server.unit("chat").runtime.trunk, server.unit("digits").runtime.trunk
        # chat: rank 8 on q_proj and v_proj of its 2 blocks, and nothing else trains
        assert adapters(chat) == {f"layers.{i}.self_attn.{m}": (8, 2.0) for i in (0, 1) for m in ("q_proj", "v_proj")}
        assert trainable(chat) and all("lora_" in n for n in trainable(chat))
        # digits: mnist-cnn has no default LoRA targets, so the server's default LoRA does not apply: it trains whole
        assert adapters(digits) == {} and trainable(digits) == {n for n, _ in digits.named_parameters()}
    finally:
        server.stop(grace=0)


def test_models_with_different_lora_get_only_the_adapters_they_asked_for(llama_dir: Path) -> None:
    defaults = {"lora_rank": 2}
    specs = [parse_model_flag(f"a={llama_dir}:1,3 lora-rank=4 lora-alpha=2 lora-targets=o_proj", defaults),
             parse_model_flag(f"b={llama_dir}:1,3", defaults),  # the defaults: rank 2 on every projection
             parse_model_flag("c=mnist-cnn:3,6 lora-targets=3", defaults),  # the CNN's trunk convolution
             parse_model_flag(f"d={llama_dir}:1,3 lora-rank=0", defaults)]
    server = TrunkServer(models=specs, insecure=True, port=0).start()
    try:
        trunks = {name: server.unit(name).runtime.trunk for name in "abcd"}
        assert adapters(trunks["a"]) == {f"layers.{i}.self_attn.o_proj": (4, 0.5) for i in (0, 1)}
        projections = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                       "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
        assert adapters(trunks["b"]) == {f"layers.{i}.{m}": (2, 2.0) for i in (0, 1) for m in projections}
        assert list(adapters(trunks["c"]).values()) == [(2, 2.0)] and \
            type(dict(trunks["c"].named_modules())[next(iter(adapters(trunks["c"])))].base_layer).__name__ == "Conv2d"
        assert adapters(trunks["d"]) == {} and trainable(trunks["d"]) == {n for n, _ in trunks["d"].named_parameters()}
    finally:
        server.stop(grace=0)


def test_a_model_that_asks_for_lora_without_targets_is_refused_saying_to_set_them() -> None:
    spec = parse_model_flag("digits=mnist-cnn:3,6 lora-rank=4", {"lora_rank": 8})
    assert not spec.lora_optional
    with pytest.raises(ConfigError, match=r"model 'digits' asks for LoRA .* set lora-targets .* 3 \(Conv2d\)"):
        estimate(spec)
    with pytest.raises(ConfigError, match="asks for LoRA .* set lora-targets"):  # in a models file too
        estimate(ModelSpec.from_mapping({"model": "mnist-cnn", "cuts": "3,6", "lora-rank": 4}, "digits"))


def test_per_model_lora_keys_in_a_models_file(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text('[models.digits]\nmodel = "mnist-cnn"\ncuts = "3,6"\nlora-rank = 4\nlora-targets = [3]\n'
                    '[models.chat]\nmodel = "smollm2-135m"\nlora-rank = 8\nlora-alpha = 32\n'
                    'lora-targets = "q_proj,v_proj"\n')
    digits, chat = read_models_file(path)
    assert (digits.lora_rank, digits.lora_targets) == (4, ("3",))
    assert (chat.lora_rank, chat.lora_alpha, chat.lora_targets) == (8, 32.0, ("q_proj", "v_proj"))
    with pytest.raises(ConfigError, match="lora-targets"):
        ModelSpec("mnist-cnn", lora_targets=[True])
    with pytest.raises(ConfigError, match="colour"):
        parse_model_flag("mnist-cnn colour=red")


def test_models_load_carries_lora_rank_alpha_and_targets_to_the_server(llama_dir: Path, tmp_path: Path) -> None:
    from splitfed.cli.main import main

    token = tmp_path / "admin.token"
    token.write_text("a" * 32)
    server = TrunkServer(models=[ModelSpec("mnist-cnn", name="digits", cuts=(3, 6))], insecure=True, port=0,
                         admin_token="a" * 32).start()
    try:
        assert main(["models", "load", str(llama_dir), "--name", "chat", "--cuts", "1,3", "--lora-rank", "4",
                     "--lora-alpha", "2", "--lora-targets", "o_proj,v_proj", "--server", server.address,
                     "--admin-token-file", str(token)]) == 0
        chat = server.unit("chat").runtime.trunk
        assert adapters(chat) == {f"layers.{i}.self_attn.{m}": (4, 0.5) for i in (0, 1) for m in ("o_proj", "v_proj")}
        assert all("lora_" in n for n in trainable(chat))
    finally:
        server.stop(grace=0)
