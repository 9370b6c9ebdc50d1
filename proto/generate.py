"""Regenerate the split channel's Python code from its .proto source.

Run from the repository root: ``python proto/generate.py``. The generated
modules are committed under ``splitfed/channel/``; ``tests/test_proto.py``
checks that they match what this script produces.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO = "splitfed/channel/split_channel.proto"


def generate(out_dir: Path) -> None:
    """Write ``split_channel_pb2{,_grpc}.py`` and the ``.pyi`` under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT / 'proto'}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(ROOT / "proto" / PROTO),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
