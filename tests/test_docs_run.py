"""Every Python block of README.md and docs/*.md runs as a reader would run it (see ``doc_blocks``): a document's
blocks in order in a namespace of their own, from a scratch folder, with tiny models where the document uses
large ones and a free port for 50051 (all documents in one fresh interpreter, so its imports are paid once). A
block marked ``<!-- not-run: reason -->`` is counted, not run."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from doc_blocks import DOCS, ROOT, python_blocks, run_documents, substitute

#: Blocks the tests do not run, by document, each with the reason the document gives. A new one must be added here.
NOT_RUN = {"docs/replicas.md": 1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_bert(folder: Path) -> None:
    """A tiny BERT classifier with a WordPiece tokenizer over docs/python_api.md's words (stands in for minilm-l6)."""
    import re

    import torch
    from conftest import tiny_config
    from transformers import BertForSequenceClassification, BertTokenizerFast

    torch.manual_seed(0)
    text = (ROOT / "docs" / "python_api.md").read_text()
    words = sorted({w.lower() for w in re.findall(r"[A-Za-z]+", text)})
    folder.mkdir()
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "?"] + words))
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
    config = tiny_config("bert")
    config.vocab_size = len(words) + 7
    config.num_labels = 2  # as docs/python_api.md loads it
    BertForSequenceClassification(config).save_pretrained(folder)


def _tiny_llama(folder: Path) -> None:
    """A tiny Llama with a byte-level tokenizer (stands in for smollm2-135m)."""
    from llm_fixtures import save_tiny

    save_tiny("llama", folder)


# What each document needs to run here: files made before it runs (in its scratch folder), code run before its
# blocks (in the same interpreter), and (old, new) substitutions in its blocks.
TRUNK_HOST = """
from splitfed import split_model as _split
from splitfed.channel.server.trunkserver import TrunkServer as _Server
from splitfed.models.catalog import build_model as _build
_trunk_host = _Server(_split(_build("tiny-gpt2", vocab_size=512), (2, 4)).trunk, insecure=True).start()
TRUNK_ADDRESS = _trunk_host.address  # stands in for trunk-host:50051
"""
SETUP: dict[str, tuple[Callable[[Path], None] | None, str, list[tuple[str, str]]]] = {
    "README.md": (lambda d: _tiny_llama(d / "tiny-llama"), "", [('"HuggingFaceTB/SmolLM2-135M"', '"tiny-llama"')]),
    "docs/python_api.md": (lambda d: _tiny_bert(d / "tiny-bert"), "", [('"minilm-l6"', '"tiny-bert"')]),
    "docs/serving.md": (lambda d: _tiny_llama(d / "tiny-llama"), "", [
        ('"HuggingFaceTB/SmolLM2-135M"', '"tiny-llama"')]),
    "docs/generation.md": (lambda d: _tiny_llama(d / "tiny-llama"), "", [
        ('"smollm2-135m"', '"tiny-llama"'), ("(3, 27)", "(1, 3)"), ("+ 64", "+ 8"),
        ("max_new_tokens=64", "max_new_tokens=8")]),
    "docs/micro_batches.md": (None, TRUNK_HOST, [('"trunk-host:50051"', "TRUNK_ADDRESS")]),
    "docs/privacy.md": (None, "", [("steps=30", "steps=3"), ('"image"), 30)', '"image"), 3)')]),
}


TEST_SETUP = {doc for doc, (_, setup, _) in SETUP.items() if setup}


def _documents_with_blocks() -> list[str]:
    return [str(doc.relative_to(ROOT)) for doc in DOCS
            if any(b.not_run is None for b in python_blocks(doc))]


def test_every_python_block_is_run_or_marked_with_a_reason() -> None:
    blocks = [b for doc in DOCS for b in python_blocks(doc)]
    not_run: dict[str, int] = {}
    for block in blocks:
        if block.not_run is not None:
            assert block.not_run.strip(), f"{block.label}: a not-run block must say why"
            not_run[block.doc] = not_run.get(block.doc, 0) + 1
    assert not_run == NOT_RUN, f"not-run blocks changed: {not_run}"
    run = len(blocks) - sum(not_run.values())
    assert run >= 14, f"{run} blocks run, {sum(not_run.values())} not run"
    assert set(SETUP) <= set(_documents_with_blocks())


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, dict], str]:
    """Every document's blocks, run once: the results by document, and the interpreter's stderr."""
    workdir = tmp_path_factory.mktemp("docs")
    documents = []
    for doc in _documents_with_blocks():
        folder = workdir / doc.replace("/", "-")
        folder.mkdir()
        make, setup, substitutions = SETUP.get(doc, (None, "", []))
        if make is not None:
            make(folder)
        program = ([(f"{doc} (test setup)", setup)] if setup else []) + substitute(python_blocks(ROOT / doc),
                                                                               substitutions)
        port = str(_free_port())
        documents.append((doc, folder, [(label, code.replace("50051", port)) for label, code in program]))
    results, process = run_documents(documents, workdir)
    assert results, f"the blocks' interpreter died:\n{process.stdout[-2000:]}\n{process.stderr[-4000:]}"
    return results, process.stderr


@pytest.mark.parametrize("doc", _documents_with_blocks())
def test_the_documents_python_blocks_run(doc: str, ran: tuple[dict[str, dict], str]) -> None:
    results, _ = ran
    result = results[doc]
    assert "error" not in result, f"{doc}: ran {result['ran']}, then\n{result['error']}"
    assert len(result["ran"]) == len([b for b in python_blocks(ROOT / doc) if b.not_run is None]) + (doc in TEST_SETUP)


def test_the_blocks_leave_stderr_free_of_tracebacks_and_warnings(ran: tuple[dict[str, dict], str]) -> None:
    _, stderr = ran
    for noise in ("Traceback", "Exception ignored", "Got goaway", "Full backward hook", "Warning:"):
        assert noise not in stderr, f"{noise!r} on stderr:\n{stderr[-3000:]}"
