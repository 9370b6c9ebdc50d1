"""Layers import one way: apps -> strategies -> splitfed; flwr only in strategies/ and apps/;
grpc and the generated stubs only in the channel code; no unpickling of network data anywhere."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHANNEL = ROOT / "splitfed" / "channel"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _top(name: str) -> str:
    return name.split(".")[0]


def test_flwr_only_in_strategies_and_apps() -> None:
    for path in _files("splitfed"):
        assert "flwr" not in {_top(n) for n in _imports(path)}, f"{path} imports flwr"


def test_grpc_and_stubs_only_in_channel_code() -> None:
    for path in _files("splitfed") + _files("strategies") + _files("apps"):
        if CHANNEL in path.parents:
            continue
        imports = _imports(path)
        tops = {_top(n) for n in imports}
        assert not tops & {"grpc", "grpc_health", "grpc_reflection"}, f"{path} imports grpc"
        assert not any("split_channel_pb2" in n for n in imports), f"{path} imports generated stubs"


def test_import_direction() -> None:
    for path in _files("splitfed"):
        assert not {_top(n) for n in _imports(path)} & {"strategies", "apps"}, f"{path} imports upward"
    for path in _files("strategies"):
        assert "apps" not in {_top(n) for n in _imports(path)}, f"{path} imports apps"


def test_splitting_is_plain_torch() -> None:
    for path in _files("splitfed/split"):
        tops = {_top(n) for n in _imports(path)}
        assert tops <= {"__future__", "copy", "dataclasses", "typing", "collections", "torch", "transformers",
                        "splitfed", "math", "logging", "safetensors", "json", "pathlib", "os", "contextlib",
                        "functools", "inspect"}, path


def test_no_unpickling_of_untrusted_data() -> None:
    """No pickle, eval/exec or torch.load without weights_only=True in the library and apps."""
    for path in _files("splitfed") + _files("strategies") + _files("apps"):
        tree = ast.parse(path.read_text())
        assert not {_top(n) for n in _imports(path)} & {"pickle", "dill", "cloudpickle", "marshal"}, path
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if isinstance(func, ast.Name):  # the builtins, not nn.Module.eval()
                    assert name not in {"eval", "exec"}, f"{path}:{node.lineno} calls {name}"
                if name == "load" and isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "torch":
                    kw = {k.arg: k.value for k in node.keywords}
                    assert isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True, \
                        f"{path}:{node.lineno} torch.load without weights_only=True"
