"""Serving models: what a served model is (:mod:`~splitfed.serving.spec`), how much memory it takes
(:mod:`~splitfed.serving.memory`), how its trunk is built (:mod:`~splitfed.serving.build`), and the three-line
entry points :func:`serve` and :func:`connect` (:mod:`~splitfed.serving.api`). Pure torch: the gRPC side is
:mod:`splitfed.channel.server.trunkserver`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from splitfed.serving.spec import ModelSpec, read_models_file

if TYPE_CHECKING:
    from splitfed.serving.api import RemoteLM, connect, serve

__all__ = ["ModelSpec", "RemoteLM", "connect", "read_models_file", "serve"]


def __getattr__(name: str) -> Any:
    """:mod:`~splitfed.serving.api` (torch) is imported on first use: a spec alone needs neither torch nor gRPC."""
    if name in ("RemoteLM", "connect", "serve"):
        from splitfed.serving import api

        return getattr(api, name)
    raise AttributeError(f"module 'splitfed.serving' has no attribute {name!r}")
