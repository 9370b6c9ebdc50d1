"""The error for a model that needs code of its own (``trust_remote_code``), which splitfed never runs.

transformers refuses such a model with advice that does not fit here: it asks for
``trust_remote_code=True`` (no splitfed command takes it, on purpose: the code would run inside a trunk
server or a client), and for a local folder or a downloaded snapshot it points at ``https://hf.co/`` followed by
the folder's path. :func:`custom_code_error` says instead what the model needs, where its files are (the
folder, or its page on the hub for a hub id) and what to do.
"""

from __future__ import annotations

import json
from pathlib import Path

from splitfed.errors import UnsupportedModelError
from splitfed.split.families import SUPPORTED_FAMILIES

HUB_URL = "https://huggingface.co/"


def needs_custom_code(exc: BaseException) -> bool:
    """Whether transformers refused to load something because it needs its own code."""
    return isinstance(exc, ValueError) and "trust_remote_code" in str(exc)


def where_to_look(source: str, folder: Path) -> str:
    """Where a person can read the model's files: the local folder, or the hub page of a hub id."""
    if Path(source).expanduser().exists():
        return str(Path(source).expanduser().resolve())
    return HUB_URL + source.strip("/") if source.count("/") <= 1 else str(folder)


def custom_code_error(source: str, folder: Path, what: str = "model") -> UnsupportedModelError:
    """The error for ``source`` (read from ``folder``), whose ``what`` (model, tokenizer) needs code of its own."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    model_type = config.get("model_type") or "?"
    code = sorted({str(v).split(".")[0] + ".py" for v in (config.get("auto_map") or {}).values()
                   if isinstance(v, str)})
    import transformers

    named = f" ({', '.join(code)})" if code else ""
    return UnsupportedModelError(
        f"the {what} of {source} needs code of its own to load{named}: its model_type {model_type!r} is not one "
        f"that transformers {transformers.__version__} ships, and splitfed never runs code that comes with a model "
        f"(there is no trust_remote_code option). Use a model of an architecture splitfed splits "
        f"({', '.join(sorted(SUPPORTED_FAMILIES))}), or a transformers release that ships {model_type!r}; the "
        f"model's files: {where_to_look(source, folder)}")
