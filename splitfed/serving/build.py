"""A served model's trunk and runtime, built from its :class:`~splitfed.serving.spec.ModelSpec` (pure torch).

The trunk is read part-only (a pretrained model's embeddings and head are never
read), gets its LoRA adapters, moves to the spec's device and gets the trunk
mode's aggregator and its optimizer. The channel side wraps the runtime in a
scheduler and a servicer (:mod:`splitfed.channel.units`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from splitfed.config import RunConfig
from splitfed.errors import ConfigError, ModelLoadError
from splitfed.serving.spec import ModelSpec, looks_like_path
from splitfed.trunk.aggregation import TrunkAggregator, make_aggregator
from splitfed.trunk.runtime import GradientGuard, TrunkRuntime
from splitfed.trunk.store import StoreLimits

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
    from splitfed.models import NAMED

    if model in NAMED:
        return NAMED[model].default_cuts
    from splitfed.llm import NAMED_LLMS, load_config

    if model in NAMED_LLMS:
        return NAMED_LLMS[model].default_cuts
    layers = int(getattr(load_config(model), "num_hidden_layers", 0) or 0)
    if layers < 3:
        raise ConfigError(f"model {model!r} has {layers} blocks; give cuts a,b explicitly")
    return 1, layers - 1


def run_config(spec: ModelSpec) -> RunConfig:
    """The run settings that :func:`splitfed.parts.build_parts` reads for ``spec``."""
    check_source(spec.model)
    return RunConfig(model=spec.model, cuts=spec.cuts or default_cuts(spec.model), seed=spec.seed,
                     lora_rank=spec.lora_rank)


def build_trunk(spec: ModelSpec) -> tuple[nn.Module, tuple[int, int]]:
    """The trunk of ``spec`` on its device, with its adapters, and its cuts."""
    from splitfed.parts import ALL_ROLES, build_parts, is_pretrained, model_cuts

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
    ``compile``: its blocks compiled (:mod:`splitfed.trunk.compiled`)."""
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
    log.info("built model %s (%s, blocks %d..%d on %s, %s)", spec.name, spec.model, cuts[0], cuts[1] - 1,
             spec.device, aggregator.describe())
    return BuiltModel(spec, runtime, cuts)
