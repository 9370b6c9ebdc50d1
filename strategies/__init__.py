"""Flower strategies that drive SplitFed rounds (the only layer besides apps/ that imports flwr)."""

from .factory import build_strategy
from .metrics import aggregate_split_metrics
from .splitfed import SPLITFED_RECORD, SplitFed

__all__ = ["SPLITFED_RECORD", "SplitFed", "aggregate_split_metrics", "build_strategy"]
