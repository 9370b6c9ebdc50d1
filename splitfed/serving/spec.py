"""What one served model is: :class:`ModelSpec`, from keyword arguments, a TOML table or the command line.

A trunk server may hold several models; each has a name (what clients ask for
with ``x-splitfed-model``), a source (a named model, a local folder or a hub
id), its cuts, LoRA rank, device, trunk mode and the other settings of
``splitfed serve``. Keys in a models file are kebab-case, one table per model::

    [models.digits]
    model = "mnist-cnn"
    cuts = "3,6"
    trunk-mode = "async"

    [models.chat]
    model = "/models/smollm2"
    cuts = [3, 27]
    lora-rank = 8
    lora-targets = ["q_proj", "v_proj"]
    device = "cuda:0"

On the command line (``splitfed serve --model``) a model is ``[NAME=]SOURCE[:A,B]``, followed in the same
argument by any of these keys as ``KEY=VALUE`` (:func:`parse_model_flag`); the other ``serve`` options are every
``--model``'s defaults. LoRA from those defaults (``--lora-rank``) goes only to models LoRA has targets in by
default (:attr:`ModelSpec.lora_optional`); a model that asks for LoRA itself and has none is refused, saying to
set ``lora-targets``.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitfed.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

TRUNK_MODES = ("sync", "async", "quorum")
OPTIMIZERS = ("sgd", "adam", "adamw")
MAX_NAME_LENGTH = 128


def check_name(name: str) -> str:
    """``name`` if it can name a model (printable, no spaces, at most 128 characters), else ConfigError."""
    if not name or len(name) > MAX_NAME_LENGTH or not name.isprintable() or any(c.isspace() for c in name):
        raise ConfigError(f"a model name must be 1 to {MAX_NAME_LENGTH} printable characters without spaces, got "
                          f"{name!r}")
    return name


def parse_cuts(value: Any) -> tuple[int, int] | None:
    """Cuts from ``"a,b"``, ``[a, b]`` or None (the named model's default)."""
    if value is None or value == "" or value == []:
        return None
    try:
        parts = value.split(",") if isinstance(value, str) else list(value)
        a, b = (int(v) for v in parts)
    except (TypeError, ValueError):
        raise ConfigError(f"cuts must be two integers a,b, got {value!r}") from None
    if not 0 < a < b:
        raise ConfigError(f"cuts must satisfy 0 < a < b (the trunk holds blocks [a, b)), got {a},{b}")
    return a, b


def normalize_device(device: str) -> str:
    """``cpu`` or ``cuda:N`` (``cuda`` is ``cuda:0``)."""
    text = (device or "cpu").strip().lower()
    if text == "cuda":
        return "cuda:0"
    if text == "cpu" or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise ConfigError(f"device must be cpu, cuda or cuda:N, got {device!r}")


def parse_targets(value: Any, name: str = "") -> tuple[str, ...]:
    """LoRA targets from ``"a,b"`` or a list (of module names, or of an ``nn.Sequential`` model's layer indices)."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or any(isinstance(t, bool) or not isinstance(t, (str, int))
                                                   for t in items):
        raise ConfigError(f"lora-targets of model {name!r} must be \"a,b\" or a list of module names or layer "
                          f"indices, got {value!r}")
    targets = tuple(str(t).strip() for t in items if str(t).strip())
    if any(not t.isprintable() or any(c.isspace() for c in t) for t in targets):
        raise ConfigError(f"lora-targets of model {name!r} must be module names or layer indices, got {value!r}")
    return targets


def looks_like_path(source: str) -> bool:
    """Whether ``source`` names a local folder (absolute, ``./``, ``../`` or ``~``) rather than a hub id."""
    return source.startswith(("/", "./", "../", "~")) or source in (".", "..")


@dataclass(frozen=True)
class ModelSpec:
    """One model a trunk server holds.

    Args:
        model: a named model (``mnist-cnn``, ``smollm2-135m``), a local folder or a hub id.
        name: what clients ask for (default: ``model``).
        cuts: the trunk holds blocks ``[a, b)`` (None: the named model's default; a folder or hub id
            without a default gets ``1, n-1``).
        lora_rank: train LoRA adapters of this rank on the trunk (0: full fine-tuning).
        lora_alpha: LoRA's alpha (0: twice the rank).
        lora_targets: the modules LoRA adapts (``"q_proj,v_proj"``, a list; an ``nn.Sequential`` model's layer
            indices); empty: the architecture's projections.
        lora_optional: the LoRA settings are the server's defaults rather than this model's own: a model with no
            default LoRA targets (``mnist-cnn``'s ``nn.Sequential``, and ``lora_targets`` empty) is served
            without LoRA instead of refused.
        device: ``cpu`` or ``cuda:N``.
        trunk_mode, quorum, max_staleness, trunk_timeout: the trunk's aggregation (see ``docs/research.md``).
        optimizer, lr: the trunk's optimizer.
        batch_window_ms, max_batch_tokens: cross-client batching of trunk forwards and decode steps.
        checkpointing: activation checkpointing of the trunk.
        compile: compile the trunk's blocks with ``torch.compile`` (:mod:`splitfed.trunk.compute.compiled`).
        shared_memory_mib: shared memory each client on this host may map for this model's tensors.
        seed: seed of the adapters (and of a named model built from code).
        frozen: serve the trunk for inference only (no optimizer).
    """

    model: str
    name: str = ""
    cuts: tuple[int, int] | None = None
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_targets: tuple[str, ...] = ()
    lora_optional: bool = False
    device: str = "cpu"
    trunk_mode: str = "sync"
    quorum: int = 1
    max_staleness: int = 4
    trunk_timeout: float = 60.0
    optimizer: str = "sgd"
    lr: float = 0.01
    batch_window_ms: float = 0.0
    max_batch_tokens: int = 65536
    checkpointing: bool = False
    compile: bool = False
    shared_memory_mib: int = 256
    seed: int = 0
    frozen: bool = False

    def __post_init__(self) -> None:
        for switch in ("checkpointing", "compile", "frozen", "lora_optional"):
            if not isinstance(getattr(self, switch), bool):
                raise ConfigError(f"{switch} of model {self.name or self.model!r} must be true or false, got "
                                  f"{getattr(self, switch)!r}")
        if not isinstance(self.model, str) or not self.model.strip():
            raise ConfigError("model is empty: give a named model, a local folder or a hub id")
        object.__setattr__(self, "name", check_name(self.name or self.model))
        object.__setattr__(self, "cuts", parse_cuts(self.cuts))
        object.__setattr__(self, "lora_targets", parse_targets(self.lora_targets, self.name))
        if not (isinstance(self.lora_alpha, (int, float)) and self.lora_alpha >= 0):
            raise ConfigError(f"lora-alpha of model {self.name!r} must be a number >= 0 (0: twice the rank), got "
                              f"{self.lora_alpha!r}")
        object.__setattr__(self, "device", normalize_device(self.device))
        if self.trunk_mode not in TRUNK_MODES:
            raise ConfigError(f"trunk-mode of model {self.name!r} must be one of {', '.join(TRUNK_MODES)}, got "
                              f"{self.trunk_mode!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer of model {self.name!r} must be one of {', '.join(OPTIMIZERS)}, got "
                              f"{self.optimizer!r}")
        for key, value, low in (("lora-rank", self.lora_rank, 0), ("quorum", self.quorum, 1),
                                ("max-staleness", self.max_staleness, 0),
                                ("max-batch-tokens", self.max_batch_tokens, 1),
                                ("shared-memory-mib", self.shared_memory_mib, 0)):
            if int(value) != value or value < low:
                raise ConfigError(f"{key} of model {self.name!r} must be an integer >= {low}, got {value!r}")
        for key, value in (("lr", self.lr), ("trunk-timeout", self.trunk_timeout)):
            if not value > 0:
                raise ConfigError(f"{key} of model {self.name!r} must be > 0, got {value!r}")
        if not self.batch_window_ms >= 0:
            raise ConfigError(f"batch-window-ms of model {self.name!r} must be >= 0, got {self.batch_window_ms!r}")

    @classmethod
    def from_mapping(cls, table: Mapping[str, Any], name: str = "") -> ModelSpec:
        """A spec from a TOML table (kebab-case keys; ``name`` is the table's own name unless it sets one)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in table.items():
            attr = str(key).replace("-", "_")
            if attr not in fields:
                known = ", ".join(sorted(f.replace("_", "-") for f in fields))
                raise ConfigError(f"unknown key {key!r} in the table of model {name or '?'}; known keys: {known}")
            kwargs[attr] = value
        kwargs.setdefault("name", name)
        if "model" not in kwargs:
            raise ConfigError(f"the table of model {name or '?'} has no model key: set model = a named model, a "
                              "local folder or a hub id")
        return cls(**kwargs)

    def to_mapping(self) -> dict[str, Any]:
        """The spec as a TOML-able table (kebab-case keys)."""
        out = {f.name.replace("_", "-"): getattr(self, f.name) for f in dataclasses.fields(self)}
        out["cuts"] = list(self.cuts) if self.cuts is not None else []
        out["lora-targets"] = list(self.lora_targets)
        return out


def read_models_file(path: str | Path) -> list[ModelSpec]:
    """The models of a TOML file: one ``[models.NAME]`` table each (see the module docstring)."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"models file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"models file {path} is not valid TOML: {exc}") from None
    tables = doc.get("models")
    extra = sorted(set(doc) - {"models"})
    if extra:
        raise ConfigError(f"models file {path}: unknown top-level keys {extra}; put each model in a "
                          "[models.NAME] table")
    if not isinstance(tables, dict) or not tables:
        raise ConfigError(f"models file {path} has no [models.NAME] table")
    specs = []
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ConfigError(f"models file {path}: models.{name} must be a table")
        specs.append(ModelSpec.from_mapping(table, name=name))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"models file {path} names a model twice: {sorted(n for n in names if names.count(n) > 1)}")
    return specs


_NAME_PREFIX = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+)=(?P<rest>.+)$")
_CUTS_SUFFIX = re.compile(r"^(?P<source>.+):(?P<a>\d+),(?P<b>\d+)$")
_OPTIONS = re.compile(r"^(?P<head>.*?)(?P<options>(?:\s+[a-z][a-z0-9-]*=\S*)*)\s*$", re.DOTALL)
#: The keys that give a model LoRA of its own.
LORA_KEYS = ("lora_rank", "lora_alpha", "lora_targets")


def _typed(key: str, value: str, flag: str) -> Any:
    """A ``KEY=VALUE`` of a ``--model`` flag as the field's type (that of its default)."""
    default = {f.name: f.default for f in dataclasses.fields(ModelSpec)}[key]
    try:
        if isinstance(default, bool):
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            return value.lower() in ("true", "1", "yes")
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
    except ValueError:
        raise ConfigError(f"--model {flag!r}: {key.replace('_', '-')}={value} is not a valid "
                          f"{type(default).__name__}") from None
    return value


def parse_model_flag(text: str, defaults: Mapping[str, Any] | None = None) -> ModelSpec:
    """The spec of one ``splitfed serve --model '[NAME=]SOURCE[:A,B] [KEY=VALUE ...]'``.

    ``KEY`` is any key of a models-file table (``lora-rank=4 lora-alpha=8 lora-targets=q_proj,v_proj``,
    ``trunk-mode=async``, ...). ``defaults`` (field names: the other ``serve`` options) fill the keys the flag does
    not set. LoRA from ``defaults`` is optional for the model (:attr:`ModelSpec.lora_optional`) unless the flag sets
    a LoRA key of its own.
    """
    fields = {f.name for f in dataclasses.fields(ModelSpec)}
    match = _OPTIONS.match(text.strip())
    head, options = (match.group("head"), match.group("options").split()) if match else (text, [])
    own: dict[str, Any] = {}
    for option in options:
        key, _, value = option.partition("=")
        attr = key.replace("-", "_")
        if attr not in fields or attr in ("model", "name"):
            known = ", ".join(sorted(f.replace("_", "-") for f in fields - {"model", "name"}))
            raise ConfigError(f"--model {text!r}: unknown key {key!r}; known keys: {known}")
        if attr in own:
            raise ConfigError(f"--model {text!r}: {key} is given twice")
        own[attr] = _typed(attr, value, text)
    name, source = "", head
    prefix = _NAME_PREFIX.match(head)
    if prefix is not None and "/" not in prefix.group("name"):
        name, source = prefix.group("name"), prefix.group("rest")
    suffix = _CUTS_SUFFIX.match(source)
    if suffix is not None:
        if "cuts" in own:
            raise ConfigError(f"--model {text!r}: cuts are given twice (:A,B and cuts=)")
        source, own["cuts"] = suffix.group("source"), (int(suffix.group("a")), int(suffix.group("b")))
    kwargs = {k: v for k, v in (defaults or {}).items() if k in fields and k not in ("model", "name")}
    kwargs.update(own)
    if kwargs.get("lora_rank") and not any(k in own for k in LORA_KEYS) and "lora_optional" not in own:
        kwargs["lora_optional"] = True  # the server's default LoRA: for the models it fits
    return ModelSpec(model=source, name=name, **kwargs)
