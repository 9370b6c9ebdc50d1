"""Serving models: what a served model is (:mod:`~splitfed.serving.spec`), how much memory it takes
(:mod:`~splitfed.serving.memory`), how its trunk is built (:mod:`~splitfed.serving.build`), and the three-line
entry points :func:`serve` and :func:`connect` (:mod:`~splitfed.serving.api`). Pure torch: the gRPC side is
:mod:`splitfed.channel.server`."""

from __future__ import annotations

from splitfed.serving.api import RemoteLM, connect, serve
from splitfed.serving.spec import ModelSpec, read_models_file

__all__ = ["ModelSpec", "RemoteLM", "connect", "read_models_file", "serve"]
