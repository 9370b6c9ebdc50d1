"""Flower strategies that drive SplitFed rounds (the only layer besides apps/ that imports flwr)."""

from strategies.factory import build_strategy
from strategies.metrics import aggregate_split_metrics
from strategies.splitfed import SPLITFED_RECORD, SplitFed

__all__ = ["SPLITFED_RECORD", "SplitFed", "aggregate_split_metrics", "build_strategy"]
