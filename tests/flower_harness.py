"""Run the real ServerApp and ClientApp in one process: a Flower ``Grid`` that hands each message to the
ClientApp on a thread pool (as many at once as the pool has workers, like Ray's CPU slots).

This is the transport only; the apps, the strategy, the trunk server and the split channel are the real
ones. End-to-end runs through ``flwr run`` live in the slow tests.
"""

from __future__ import annotations

import ast
import threading
import tomllib
import uuid
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

ROOT = Path(__file__).resolve().parent.parent
SUPERLINK_NODE = 1


def default_run_config(**overrides: Any) -> dict[str, Any]:
    """``[tool.flwr.app.config]`` of pyproject.toml with ``overrides`` (snake_case keys allowed)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    for key, value in overrides.items():
        config[key.replace("_", "-")] = value
    return config


class ThreadGrid(Grid):
    """A Grid whose nodes are ClientApp calls on a thread pool."""

    def __init__(self, client_app: Any, num_nodes: int, run_config: dict[str, Any], *, concurrency: int = 2,
                 run_id: int = 7, node_configs: dict[int, dict[str, Any]] | None = None) -> None:
        self.client_app = client_app
        self.run_config = run_config
        self.run_id = run_id
        extra = node_configs or {}  # partition id -> what that SuperNode's --node-config adds
        self.contexts = {
            100 + i: Context(run_id=run_id, node_id=100 + i, node_config={"partition-id": i,
                                                                           "num-partitions": num_nodes,
                                                                           **extra.get(i, {})},
                             state=RecordDict(), run_config=run_config)
            for i in range(num_nodes)
        }
        self.pool = ThreadPoolExecutor(max_workers=concurrency)
        self._pending: dict[str, Future[Message]] = {}
        self.offline: set[int] = set()
        self.sent: list[Message] = []

    def set_run(self, run: Any) -> None:  # pragma: no cover - not used in-process
        pass

    @property
    def run(self) -> Any:  # pragma: no cover - not used in-process
        raise NotImplementedError

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:  # pragma: no cover - strategies build their own
        return Message(content=content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return [n for n in self.contexts if n not in self.offline]

    def get_nodes(self) -> Iterable[Any]:  # pragma: no cover
        raise NotImplementedError

    def _deliver(self, msg: Message) -> Message:
        context = self.contexts[msg.metadata.dst_node_id]
        try:
            return self.client_app(msg, context)
        except Exception as exc:  # as Flower does: the failure travels back as an error reply
            return Message(Error(code=0, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            msg.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE
            msg.metadata.__dict__["_run_id"] = self.run_id
            self.sent.append(msg)
            self._pending[msg.metadata.message_id] = self.pool.submit(self._deliver, msg)
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        out = []
        for mid in list(message_ids):
            future = self._pending.get(mid)
            if future is not None and future.done():
                out.append(self._pending.pop(mid).result())
        return out

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        ids = list(self.push_messages(messages))
        futures = [self._pending.pop(i) for i in ids]
        return [f.result(timeout=timeout) for f in futures]

    def close(self) -> None:
        self.pool.shutdown(wait=True)


_AST_LOCK = threading.Lock()
_AST_PARSE = ast.parse


def _serial_ast_parse(*args: Any, **kwargs: Any) -> Any:
    with _AST_LOCK:
        return _AST_PARSE(*args, **kwargs)


# CPython 3.11 (3.11.7 here) can fail with "AST constructor recursion depth mismatch" when threads build ASTs at
# once (numpy's .npy header parser, used by Flower's ArrayRecord, calls ast.literal_eval). Flower runs each
# ClientApp in its own process or actor; this harness runs several in threads of one process, so it builds
# ASTs one at a time.
ast.parse = _serial_ast_parse


def run_apps(tmp_path: Path, num_nodes: int = 4, concurrency: int = 2,
             node_configs: dict[int, dict[str, Any]] | None = None, on_grid: Any = None,
             **overrides: Any) -> tuple[ThreadGrid, Path]:
    """Run the ServerApp with :class:`ThreadGrid`; returns the grid and the output folder. ``node_configs``: what
    each partition's SuperNode adds to its node config (``--node-config``); ``on_grid`` is called with the grid
    before the ServerApp starts. The folder returned is the run's own (``latest`` in ``output-dir``)."""
    from apps.client_app import app as client_app
    from apps.server_app import app as server_app

    out = tmp_path / "outputs"
    config = default_run_config(output_dir=str(out), **overrides)
    grid = ThreadGrid(client_app, num_nodes, config, concurrency=concurrency, node_configs=node_configs)
    context = Context(run_id=grid.run_id, node_id=SUPERLINK_NODE, node_config={}, state=RecordDict(),
                      run_config=config)
    # What Flower's runtime sets in a ServerApp process.
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = grid.run_id, SUPERLINK_NODE, 1
    if on_grid is not None:
        on_grid(grid)
    try:
        server_app(grid, context)
    finally:
        grid.close()
    from splitfed.run.rundirs import latest_run

    return grid, latest_run(out) or out  # the run's own folder (<output-dir>/<time>-run<id>)


def state_digest(runner: Any) -> dict[str, str]:
    """sha256 of each part of a ServerRunner's state: trunk, trunk optimizer, client parts, the inner strategy's
    state and the clients' privacy accountants (to compare a restarted server with the one that was killed)."""
    import hashlib
    import json

    import torch

    from splitfed.run.checkpoint import flatten

    def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
        digest = hashlib.sha256()
        for key in sorted(tensors):
            value = tensors[key].detach().cpu().contiguous()
            digest.update(key.encode())
            digest.update(str(value.dtype).encode())
            digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    state = runner.runtime.state_dict()
    optimizer: dict[str, torch.Tensor] = {}
    doc = json.dumps(flatten(state["optimizer"], optimizer), sort_keys=True)
    return {
        "trunk": tensors_digest(dict(state["trunk"])),
        "trunk-version": str(state["version"]),
        "optimizer": hashlib.sha256(doc.encode()).hexdigest() + tensors_digest(optimizer),
        "clients": tensors_digest(dict(runner.client_state)),
        "strategy": tensors_digest(dict(runner.strategy_state)),
        "privacy": hashlib.sha256(json.dumps(runner.privacy_states, sort_keys=True).encode()).hexdigest(),
    }


def run_folder(output_dir: Path) -> Path:
    """The run's own folder: ``output_dir`` itself when it is one, else the run its ``latest`` names (else
    ``output_dir``, while no run has made its folder yet)."""
    from splitfed.run.rundirs import is_run_dir, latest_run

    output_dir = Path(output_dir)
    if is_run_dir(output_dir):
        return output_dir
    return latest_run(output_dir) or output_dir
