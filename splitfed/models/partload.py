"""Part-only loading from safetensors: only the tensors of the parts asked for.

:func:`load_parts` builds the model's skeleton without allocating its weights,
cuts it, and reads from the checkpoint only the tensors of the parts asked for, each
straight into its final buffer: a client never reads or allocates the trunk's
layers, and the trunk server never reads the embeddings or the head.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from splitfed.errors import ConfigError, ModelLoadError
from splitfed.models.llm import CLIENT_ROLES, NAMED_LLMS, Role, _model_class, load_config, model_dir, task_of_config
from splitfed.split import SplitModel, split_model

log = logging.getLogger(__name__)


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
