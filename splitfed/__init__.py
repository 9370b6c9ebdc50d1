"""SplitFed: split learning for the Flower federated learning framework.

The model is cut into three parts: each client keeps the bottom (embeddings and
first blocks) and the top (last blocks and head), the server keeps the trunk.
"""

from __future__ import annotations

__version__ = "0.1.0"

from typing import TYPE_CHECKING, Any

from splitfed.errors import SplitFedError

if TYPE_CHECKING:
    from splitfed.serving import ModelSpec, connect, serve
    from splitfed.split import CutState, SplitModel, split_model

__all__ = ["CutState", "ModelSpec", "SplitFedError", "SplitModel", "__version__", "connect", "serve", "split_model"]

# Imported on first use (PEP 562): `import splitfed.cli.main` and the admin commands (`splitfed models list`) stay free
# of torch and transformers, whose import takes seconds.
_LAZY = {"ModelSpec": "splitfed.serving.spec", "connect": "splitfed.serving.api", "serve": "splitfed.serving.api",
         "CutState": "splitfed.split", "SplitModel": "splitfed.split", "split_model": "splitfed.split"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'splitfed' has no attribute {name!r}")
