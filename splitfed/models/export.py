"""Export a split model as one ordinary model: ``from_pretrained`` folders for transformers,
safetensors plus a small JSON for the CNN."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from splitfed.errors import ModelLoadError
from splitfed.split import SplitModel

log = logging.getLogger(__name__)

SPLITFED_JSON = "splitfed.json"


def full_state_dict(split: SplitModel) -> dict[str, torch.Tensor]:
    """The unsplit model's state dict, put together from the three parts' key maps."""
    out: dict[str, torch.Tensor] = {}
    for part in (split.bottom, split.trunk, split.top):
        for key, value in part.state_dict().items():
            out[part.spec.full_key(key)] = value.detach()
    return out


def export_model(split: SplitModel, model_name: str, cuts: tuple[int, int], out_dir: str | Path) -> Path:
    """Write the whole trained model to ``out_dir`` (see :func:`load_exported`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = full_state_dict(split)
    meta = {"model": model_name, "cuts": list(cuts), "task": split.task}
    if split.config is None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    else:
        model = _fresh(split.config)
        missing, unexpected = model.load_state_dict(state, strict=False)
        real_missing = [k for k in missing if not _tied(model, k)]
        if real_missing or unexpected:
            raise ModelLoadError(f"exported state does not fit {type(model).__name__}: missing {real_missing[:5]}, "
                                 f"unexpected {unexpected[:5]}")
        model.save_pretrained(out)
    (out / SPLITFED_JSON).write_text(json.dumps(meta, indent=1))
    log.info("exported %s to %s", model_name, out)
    return out


def _tied(model: nn.Module, key: str) -> bool:
    return key in (getattr(model, "_tied_weights_keys", None) or {})


def _fresh(config: object) -> nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if getattr(config, "model_type", "") == "bert":
        return AutoModelForSequenceClassification.from_config(config)
    return AutoModelForCausalLM.from_config(config)


def load_exported(path: str | Path) -> nn.Module:
    """Load what :func:`export_model` wrote: a transformers model, or the named CNN."""
    folder = Path(path)
    meta_file = folder / SPLITFED_JSON
    if (folder / "config.json").exists():
        from splitfed.models.llm import load_model

        return load_model(str(folder))
    if not meta_file.exists():
        raise ModelLoadError(f"{folder} holds neither config.json nor {SPLITFED_JSON}; is it an export folder?")
    from safetensors.torch import load_file

    from splitfed.models.catalog import build_model

    meta = json.loads(meta_file.read_text())
    model = build_model(meta["model"])
    model.load_state_dict(load_file(str(folder / "model.safetensors")))
    return model
