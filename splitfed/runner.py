"""What a SplitFed run does on each side, independent of Flower (names kept importable from here).

The client's work lives in :mod:`splitfed.client`, the server's in
:mod:`splitfed.server`, the shared model and data set-up in
:mod:`splitfed.workload`, message keys in :mod:`splitfed.messages`.
"""

from __future__ import annotations

from splitfed.client import ClientResult, client_evaluate, client_train, connect_trunk
from splitfed.messages import SERVER_ROUND, TRUNK_ADDRESS, TRUNK_TOKEN
from splitfed.server import RoundRecord, ServerRunner
from splitfed.workload import _text_data, data_kind, load_splits, tokenizer_for

__all__ = ["SERVER_ROUND", "TRUNK_ADDRESS", "TRUNK_TOKEN", "ClientResult", "RoundRecord", "ServerRunner",
           "_text_data", "client_evaluate", "client_train", "connect_trunk", "data_kind", "load_splits",
           "tokenizer_for"]
