"""The committed generated code is what proto/generate.py produces from the .proto source."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ("wire/split_channel_pb2.py", "wire/split_channel_pb2.pyi", "wire/split_channel_pb2_grpc.py",
             "admin/model_admin_pb2.py", "admin/model_admin_pb2.pyi", "admin/model_admin_pb2_grpc.py")


def test_generated_code_is_current(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    module.generate(tmp_path)
    for name in GENERATED:
        fresh = (tmp_path / "splitfed" / "channel" / name).read_text()
        committed = (ROOT / "splitfed" / "channel" / name).read_text()
        assert fresh == committed, f"{name} is stale: run `python proto/generate.py` and commit the result"
