"""SplitFed: split learning for the Flower federated learning framework.

The model is cut into three parts: each client keeps the bottom (embeddings and
first blocks) and the top (last blocks and head), the server keeps the trunk.
"""

from __future__ import annotations

__version__ = "0.1.0"

from splitfed.errors import SplitFedError
from splitfed.serving import ModelSpec, connect, serve
from splitfed.split import CutState, SplitModel, split_model

__all__ = ["CutState", "ModelSpec", "SplitFedError", "SplitModel", "__version__", "connect", "serve", "split_model"]
