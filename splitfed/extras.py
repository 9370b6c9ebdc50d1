"""Optional dependencies: import one where its feature is used, or say which extra installs it.

``pip install splitfed`` is what a deployed client and a trunk server need; each extra
(``simulation``, ``data``, ``privacy``, ``plots``, ``llm``, ``tensorboard``, ``ui``, ``all``)
brings the packages of one feature. Modules never import an extra's package at import
time; they call :func:`require` where the feature starts.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from splitfed.errors import MissingExtraError

#: Top-level package -> the extra that installs it.
EXTRA_OF = {
    "ray": "simulation", "datasets": "data", "flwr_datasets": "data", "mlxtend": "data", "opacus": "privacy", "matplotlib": "plots",
    "gguf": "llm", "accelerate": "llm", "peft": "llm", "tensorboard": "tensorboard", "gradio": "ui",
}


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` for ``feature``; raise :class:`MissingExtraError` naming the extra if it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        if exc.name is not None and exc.name.split(".")[0] != top:
            raise  # the package is there but one of its own imports failed: show that error
        extra = EXTRA_OF.get(top, "all")
        raise MissingExtraError(f"{feature} needs the {top} package, which is not installed: "
                                f"pip install 'splitfed[{extra}]'") from exc
