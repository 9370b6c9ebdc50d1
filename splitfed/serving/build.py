"""A served model's trunk and runtime, built from its :class:`~splitfed.serving.spec.ModelSpec` (pure torch).

The trunk is read part-only (a pretrained model's embeddings and head are never
read), gets its LoRA adapters, moves to the spec's device and gets the trunk
mode's aggregator and its optimizer. The channel side wraps the runtime in a
scheduler and a servicer (:mod:`splitfed.channel.server.units`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from splitfed.config import RunConfig
from splitfed.errors import ConfigError, ModelLoadError
from splitfed.serving.spec import ModelSpec, looks_like_path
from splitfed.trunk.aggregation.modes import TrunkAggregator, make_aggregator
from splitfed.trunk.compute.runtime import GradientGuard, TrunkRuntime
from splitfed.trunk.compute.store import StoreLimits

log = logging.getLogger(__name__)


#: What loading a pretrained model imports (model code, LoRA). A first import holds the interpreter for seconds
#: (extension modules initialise under the GIL), so a server that loads models while it serves imports them first.
LOAD_LIBRARIES = ("transformers.modeling_utils", "transformers.modeling_layers", "transformers.models.auto",
                  "peft")


def preload_libraries() -> None:
    """Import :data:`LOAD_LIBRARIES` (those installed) now, before serving, rather than during a load; then
    move every object so far out of the garbage collector's way (``gc.freeze``): a full collection over the
    millions of objects these imports leave holds the interpreter for seconds, and a load's allocations would
    trigger one while other models serve."""
    import gc
    import importlib

    for name in LOAD_LIBRARIES:
        try:
            importlib.import_module(name)
        except ImportError:
            log.debug("%s is not installed; loads that need it will say so", name)
    gc.freeze()


def check_source(model: str) -> None:
    """Raise :class:`ModelLoadError` for a local path that is not there (a hub lookup would only hide it)."""
    if looks_like_path(model):
        path = Path(model).expanduser()
        if not path.exists():
            raise ModelLoadError(f"model folder {model} does not exist; give an existing folder written by "
                                 "save_pretrained, a named model or a hub id")


def default_cuts(model: str) -> tuple[int, int]:
    """The named model's cuts, else ``1, n-1`` (the first and last blocks on the client)."""
    from splitfed.models.catalog import NAMED

    if model in NAMED:
        return NAMED[model].default_cuts
    from splitfed.models.llm import NAMED_LLMS, load_config

    if model in NAMED_LLMS:
        return NAMED_LLMS[model].default_cuts
    layers = int(getattr(load_config(model), "num_hidden_layers", 0) or 0)
    if layers < 3:
        raise ConfigError(f"model {model!r} has {layers} blocks; give cuts a,b explicitly")
    return 1, layers - 1


def architecture(model: str) -> str:
    """The architecture family of ``model`` as its split parts name it (``sequential``, ``gpt2``, ``llama``, ...),
    from its config alone."""
    from splitfed.models.catalog import NAMED

    if model == "tiny-gpt2":
        return "gpt2"
    if model in NAMED:
        return "sequential"  # the named models built from code are nn.Sequential (mnist-cnn)
    from splitfed.models.llm import load_config

    return str(getattr(load_config(model), "model_type", "") or "")


def lora_settings(spec: ModelSpec) -> tuple[int, float, str]:
    """The LoRA rank, alpha and targets (comma-separated) ``spec``'s trunk gets. On a model without default LoRA
    targets (an ``nn.Sequential`` model, an architecture :data:`splitfed.models.lora.TARGETS` does not know) and with no
    ``lora_targets``: none when the LoRA is the server's default (``lora_optional``), else a
    :class:`~splitfed.errors.ConfigError` saying which targets there are to set."""
    from splitfed.models.lora import TARGETS

    targets = ",".join(spec.lora_targets)
    if spec.lora_rank and not targets:
        arch = architecture(spec.model)
        if arch not in TARGETS:
            if spec.lora_optional:
                log.debug("model %s is served without LoRA: %s (%s) has no default LoRA targets", spec.name,
                          spec.model, arch or "unknown architecture")
                return 0, 0.0, ""
            raise ConfigError(f"model {spec.name!r} asks for LoRA (lora-rank {spec.lora_rank}) but {spec.model} "
                              f"({arch or 'its architecture'}) has no default LoRA targets: set lora-targets to the "
                              f"modules to adapt{_target_hint(spec.model, spec.cuts)}, or lora-rank = 0")
    return spec.lora_rank, spec.lora_alpha, targets


def _target_hint(model: str, cuts: tuple[int, int] | None) -> str:
    """The layers LoRA can adapt in a named ``nn.Sequential`` model (their indices), as a hint."""
    from splitfed.models.lora import LORA_LAYER_TYPES
    from splitfed.models.catalog import NAMED, build_model

    if model not in NAMED or model == "tiny-gpt2":
        return " (the names of its Linear, Conv or Embedding modules)"
    layers = [f"{i} ({type(m).__name__})" for i, m in enumerate(build_model(model))
              if type(m).__name__ in LORA_LAYER_TYPES]
    a, b = cuts or NAMED[model].default_cuts
    return (f" (the indices of its layers: {', '.join(layers)}; with cuts {a},{b} the trunk holds layers {a} to "
            f"{b - 1}, e.g. lora-targets = \"{a}\")")


def run_config(spec: ModelSpec) -> RunConfig:
    """The run settings that :func:`splitfed.models.parts.build_parts` reads for ``spec``."""
    check_source(spec.model)
    rank, alpha, targets = lora_settings(spec)
    return RunConfig(model=spec.model, cuts=spec.cuts or default_cuts(spec.model), seed=spec.seed,
                     lora_rank=rank, lora_alpha=alpha, lora_targets=targets)


def build_trunk(spec: ModelSpec) -> tuple[nn.Module, tuple[int, int]]:
    """The trunk of ``spec`` on its device, with its adapters, and its cuts."""
    from splitfed.models.parts import ALL_ROLES, build_parts, is_pretrained, model_cuts

    cfg = run_config(spec)
    split = build_parts(cfg, ("trunk",) if is_pretrained(cfg) else ALL_ROLES)
    trunk = split.trunk.to(spec.device)
    if spec.frozen:
        trunk.requires_grad_(False)
    return trunk, model_cuts(cfg)


def make_runtime(trunk: nn.Module, *, optimizer: str = "sgd", lr: float = 0.01, momentum: float = 0.0,
                 weight_decay: float = 0.0, aggregator: TrunkAggregator | None = None,
                 store_limits: StoreLimits = StoreLimits(), guard: GradientGuard = GradientGuard(),
                 checkpointing: bool = False, compile: bool = False) -> TrunkRuntime:
    """A runtime around ``trunk`` with an optimizer over its trainable parameters (none when it has none);
    ``compile``: its blocks compiled (:mod:`splitfed.trunk.compute.compiled`)."""
    from splitfed.optim import make_optimizer

    trainable = [p for p in trunk.parameters() if p.requires_grad]
    opt = make_optimizer(optimizer, trainable, lr, momentum=momentum, weight_decay=weight_decay) \
        if trainable else None
    return TrunkRuntime(trunk, opt, aggregator=aggregator, limits=store_limits, guard=guard,
                        checkpointing=checkpointing, compile=compile)


@dataclass
class BuiltModel:
    """A spec's runtime and cuts, ready for a scheduler and a servicer."""

    spec: ModelSpec
    runtime: TrunkRuntime
    cuts: tuple[int, int]


def build_model(spec: ModelSpec) -> BuiltModel:
    """Read and build ``spec``'s trunk and runtime (the slow part of loading a model)."""
    trunk, cuts = build_trunk(spec)
    aggregator = make_aggregator(spec.trunk_mode, quorum=spec.quorum, max_staleness=spec.max_staleness,
                                 timeout=spec.trunk_timeout)
    runtime = make_runtime(trunk, optimizer=spec.optimizer, lr=spec.lr, aggregator=aggregator,
                           checkpointing=spec.checkpointing, compile=spec.compile)
    rank, _, targets = lora_settings(spec)
    lora = (f"LoRA rank {rank} on {targets or 'the default targets'}" if rank else
            "no LoRA (no default LoRA targets; give it lora-targets for LoRA)" if spec.lora_rank else "no LoRA")
    log.info("built model %s (%s, blocks %d..%d on %s, %s, %s)", spec.name, spec.model, cuts[0], cuts[1] - 1,
             spec.device, aggregator.describe(), lora)
    return BuiltModel(spec, runtime, cuts)
