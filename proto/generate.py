"""Regenerate the split channel's and the model admin service's Python code from their .proto sources.

Run from the repository root: ``python proto/generate.py``. The generated
modules are committed under ``splitfed/channel/`` (and ``splitfed/channel/admin/``); ``tests/test_proto.py``
checks that they match what this script produces.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ("splitfed/channel/wire/split_channel.proto", "splitfed/channel/admin/model_admin.proto")


def generate(out_dir: Path) -> None:
    """Write each proto's ``*_pb2{,_grpc}.py`` and ``.pyi`` under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT / 'proto'}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(ROOT / "proto" / proto) for proto in PROTOS),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
