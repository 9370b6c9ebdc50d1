"""Layers import one way: apps -> strategies -> splitfed; flwr only in strategies/ and apps/;
grpc and the generated stubs only in the channel code; inside the channel, its layers (wire, security,
engine, transports, client, admin, server, routing) import one way; no unpickling of network data anywhere."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHANNEL = ROOT / "splitfed" / "channel"

#: The channel's layers and the layers each may import (besides itself). Lower layers come first; nothing
#: imports upward, and the client and the server never import each other.
CHANNEL_LAYERS: dict[str, set[str]] = {
    "wire": set(),                      # protobuf messages <-> tensors, frames, limits, replies, retries
    "security": {"wire"},               # TLS, auto-TLS, bulk TLS, client tokens
    "engine": {"wire"},                 # the event loop, front-end processes and the engine link
    "transports": {"wire", "security", "engine"},  # grpc/, shm/, bulk/, direct/
    "client": {"wire", "security", "transports"},
    "admin": {"wire", "security"},      # the model admin API's messages and client
    "server": {"wire", "security", "engine", "transports", "admin"},
    "routing": {"wire", "security", "engine"},
}

#: The library's packages that know nothing of the network: splitting, the tensor codec, the trunk's compute.
NO_CHANNEL = ("split", "codec", "privacy")


def _module(path: Path) -> str:
    """The dotted name a file of this checkout is imported by (``splitfed.channel.wire.limits``)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, relative imports resolved against its own package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
            else:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _top(name: str) -> str:
    return name.split(".")[0]


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


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
    """apps -> strategies -> splitfed, under the repository's names and the installed ones alike."""
    upward = ("strategies", "apps", "splitfed.strategies", "splitfed.apps")
    for path in _files("splitfed"):
        bad = {n for n in _imports(path) if any(_within(n, u) for u in upward)}
        assert not bad, f"{path} imports upward: {bad}"
    for path in _files("strategies"):
        bad = {n for n in _imports(path) if _within(n, "apps") or _within(n, "splitfed.apps")}
        assert not bad, f"{path} imports apps: {bad}"


def test_channel_layers_import_one_way() -> None:
    layers = {p.name for p in CHANNEL.iterdir() if (p / "__init__.py").exists()}
    assert layers == set(CHANNEL_LAYERS), f"channel layers changed: {sorted(layers)}; update CHANNEL_LAYERS"
    for layer, allowed in CHANNEL_LAYERS.items():
        for path in _files(f"splitfed/channel/{layer}"):
            for name in _imports(path):
                if not _within(name, "splitfed.channel"):
                    continue
                other = name.split(".")[2] if name.count(".") >= 2 else None
                if other is None or other == layer or other not in CHANNEL_LAYERS:
                    continue
                assert other in allowed, f"{path} ({layer}) imports {name} ({other}): the channel's layers run " \
                                         f"one way, {layer} may import {sorted(allowed)}"


def test_channel_modules_live_in_a_layer() -> None:
    """No module sits flat in splitfed/channel/ beside its layers."""
    flat = [p.name for p in CHANNEL.glob("*.py") if p.name != "__init__.py"]
    assert not flat, f"modules outside the channel's layers: {flat}"


def test_pure_packages_know_no_channel() -> None:
    for package in NO_CHANNEL:
        for path in _files(f"splitfed/{package}"):
            bad = {n for n in _imports(path) if _within(n, "splitfed.channel")}
            assert not bad, f"{path} imports the channel: {bad}"


def test_splitting_is_plain_torch() -> None:
    for path in _files("splitfed/split"):
        tops = {_top(n) for n in _imports(path)}
        assert tops <= {"__future__", "copy", "dataclasses", "typing", "collections", "torch", "transformers",
                        "splitfed", "math", "logging", "safetensors", "json", "pathlib", "os", "contextlib",
                        "functools", "inspect", "re"}, path


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
