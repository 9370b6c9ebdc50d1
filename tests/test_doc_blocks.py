"""Every fenced block of README.md and docs/ (recursively) is run or checked as a reader would meet it.

- ``python`` blocks run in ``test_docs_run.py``; here they must at least compile.
- shell blocks (``bash``, ``sh``, ``console``, ``shell``, and untagged or ``text`` blocks of commands): every command
  is checked by its program's own parser, or runs when it is quick (see ``doc_commands``).
- ``toml`` blocks parse and their keys are known (a models file loads with ``splitfed serve``'s reader; other TOML
  is app config, checked against pyproject's ``[tool.flwr.app.config]``); ``yaml`` blocks parse.
- untagged or ``text`` blocks without a command are output or formulas: nothing to run.

:data:`NOT_CHECKED` lists, with the reason, the blocks holding a command that cannot be checked here; every entry
must still match a block (so the list stays honest), and that block's other commands are still checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from doc_blocks import DOCS, ROOT, Fenced, fenced_blocks
from doc_commands import UNCHECKABLE, Checker, Failed, check_toml, check_yaml, split_script

SHELL_LANGS = {"bash", "sh", "console", "shell", "zsh"}
#: Programs whose first word marks an untagged block as commands rather than output.
COMMAND_WORDS = {"python", "python3", "splitfed", "flwr", "pip", "sudo", "flower-superlink", "flower-supernode"}

#: Blocks holding a command that cannot be checked here, by (document, a snippet of the block): the reason.
NOT_CHECKED: dict[tuple[str, str], str] = {
    ("docs/chat.md", "apt-get install -y chromium"):
        "installs a system browser (root, a package mirror); the pytest line after it is checked",
    ("docs/observability.md", "curl -s http://127.0.0.1:9464/metrics"):
        "reads the metrics endpoint of a running `flwr run` (a simulation of minutes); the flwr line is checked",
}


def _kind(block: Fenced) -> str:
    if block.lang == "python":
        return "python"
    prompted = any(line.strip().startswith("$ ") for line in block.text.splitlines())
    if block.lang in SHELL_LANGS:
        return "prompted" if prompted else "shell"
    if block.lang == "toml":
        return "toml"
    if block.lang in {"yaml", "yml"}:
        return "yaml"
    if block.lang in {"", "text"}:
        lines = [line.strip() for line in block.text.splitlines() if line.strip()]
        if prompted:
            return "prompted"
        first = next((line for line in lines if not line.startswith("#")), "")
        if first.split(" ", 1)[0] in COMMAND_WORDS or re.match(r"^[A-Z_]+=\S+ (python|splitfed|flwr)", first):
            return "shell"
        return "output"
    return "unknown"


def _listed(block: Fenced) -> str | None:
    return next((reason for (doc, snippet), reason in NOT_CHECKED.items()
                 if doc == block.doc and snippet in block.text), None)


def check_document(doc: str, scratch: Path) -> tuple[dict[str, list[str]], list[str]]:
    """Check every block of ``doc`` in order. Returns the blocks' labels by outcome (python, ran, checked, output,
    not-checked) and the failures."""
    checker = Checker(doc, scratch)
    outcome: dict[str, list[str]] = {k: [] for k in ("python", "ran", "checked", "output", "not-checked")}
    failures: list[str] = []
    for block in fenced_blocks(ROOT / doc):
        kind = _kind(block)
        try:
            if kind == "python":
                compile(block.text, block.label, "exec")
                outcome["python" if block.not_run is None else "not-checked"].append(block.label)
            elif kind == "output":
                outcome["output"].append(block.label)
            elif kind == "toml":
                check_toml(block.text, block.label)
                outcome["checked"].append(block.label)
            elif kind == "yaml":
                check_yaml(block.text, block.label)
                outcome["checked"].append(block.label)
            elif kind in {"shell", "prompted"}:
                script = split_script(block.text, prompt_only=kind == "prompted")
                checker.add_heredocs(script.heredocs)
                listed = _listed(block)
                results = []
                for argv in script.commands:
                    if listed is not None and argv[0] in UNCHECKABLE:
                        results.append("not-checked")
                        continue
                    try:
                        results.append(checker.check(argv))
                    except AssertionError as exc:  # Failed and the checks' asserts
                        failures.append(f"{block.label}: {exc}")
                        results.append("failed")
                if "not-checked" in results:
                    outcome["not-checked"].append(block.label)
                elif results and all(r == "ran" for r in results):
                    outcome["ran"].append(block.label)
                elif "failed" not in results:
                    outcome["checked"].append(block.label)
            else:
                failures.append(f"{block.label}: a ```{block.lang} block: no check knows it; add one")
        except (Failed, AssertionError, SyntaxError) as exc:
            failures.append(f"{block.label}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a reader's tool refusing the block (a ConfigError, ...)
            failures.append(f"{block.label}: {type(exc).__name__}: {exc}")
    outcome["commands that ran"] = checker.ran
    return outcome, failures


DOC_NAMES = [str(doc.relative_to(ROOT)) for doc in DOCS if fenced_blocks(doc)]


@pytest.mark.parametrize("doc", DOC_NAMES)
def test_every_block_of_the_document_runs_or_checks(doc: str, tmp_path: Path) -> None:
    outcome, failures = check_document(doc, tmp_path)
    assert not failures, "\n".join(failures)
    counted = sum(len(v) for k, v in outcome.items() if k != "commands that ran")
    assert counted == len(fenced_blocks(ROOT / doc)), outcome


def test_every_not_checked_entry_matches_a_block() -> None:
    blocks = {doc: fenced_blocks(ROOT / doc) for doc in DOC_NAMES}
    stale = [key for key in NOT_CHECKED if not any(key[1] in b.text for b in blocks.get(key[0], []))]
    assert not stale, f"NOT_CHECKED entries match no block any more (remove or update them): {stale}"


def test_tiny_llama_is_made_by_a_documented_command_before_its_first_use() -> None:
    for doc in ("docs/chat.md", "README.md"):
        text = (ROOT / doc).read_text()
        assert "python -m splitfed.models.tiny_llama ./tiny-llama" in " ".join(text.split()), doc
        text = " ".join(text.split())
        assert text.index("python -m splitfed.models.tiny_llama ./tiny-llama") < text.index("--model ./tiny-llama"), doc


# ----------------------------------------------------------------------------- the checks themselves catch errors


def _check(text: str, tmp_path: Path) -> None:
    checker = Checker("docs/x.md", tmp_path)
    for argv in split_script(text).commands:
        checker.check(argv)


@pytest.mark.parametrize("text, message", [
    ("splitfed serve --model mnist-cnn --no-such-flag", "unrecognized arguments"),
    ("splitfed serve --model mnist-cnn --cuts three", "--cuts"),
    ('flwr run . local --run-config "no-such-key=1"', "no-such-key"),
    ("flwr run . local --run-config \"num-server-rounds='five'\"", "num-server-rounds"),
    ("flwr run . local --no-such-flag", "no-such-flag"),
    ("flwr run . remote --stream", "no connection 'remote'"),
    ("python -m bench.no_such_module", "no such module"),
    ("python -m bench.wan --no-such-flag 1", "unrecognized arguments"),
    ("python examples/no_such_example.py", "does not exist"),
    ("splitfed chat --server 127.0.0.1:1 --model ./no-such-folder --insecure", "no-such-folder"),
    ("pip install -e '.[no-such-extra]'", "no-such-extra"),
    ('flower-supernode --insecure --superlink 127.0.0.1:9092 --node-config "partition-id=0 colour=1"', "colour"),
    ("curl -s http://127.0.0.1:1/", "cannot be checked"),
])
def test_a_wrong_command_fails_its_check(text: str, message: str, tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match=re.escape(message)):
        _check(text, tmp_path)


def test_right_commands_pass_and_outputs_count_as_made(tmp_path: Path) -> None:
    _check("python -m bench.trunk --clients 8 --timeline t.json --config 'layers=2'\n"
           "python -m bench.timeline_plot t.json t.png\n"
           'FLWR_X=1 flwr run . local --run-config "num-server-rounds=2 lr=1 trunk-mode=\'async\'"\n'
           "splitfed serve --model mnist-cnn --cuts 3,6 --port 50051 --insecure &\n"
           "pip install -e '.[ui,test]'", tmp_path)


@pytest.mark.parametrize("text, message", [
    ('[models.a]\nmodel = "mnist-cnn"\ncuts = "3,6"\nno-such-key = 1\n', "no-such-key"),
    ("dp-no-such = 1.0\n", "dp-no-such"),
    ('dp-max-grad-norm = "1"\n', "dp-max-grad-norm"),
])
def test_a_wrong_toml_block_fails_its_check(text: str, message: str) -> None:
    with pytest.raises(Exception, match=re.escape(message)):
        check_toml(text, "docs/x.md:1")


def test_the_tiny_llama_the_docs_make_generates_offline(tmp_path: Path) -> None:
    """``python -m splitfed.models.tiny_llama DIR`` (docs/chat.md) makes a folder ``splitfed generate --chat`` runs on."""
    import contextlib
    import io

    from splitfed.cli.main import main
    from splitfed.models.tiny_llama import main as make

    assert make([str(tmp_path / "tiny-llama")]) == 0
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["generate", "--model", str(tmp_path / "tiny-llama"), "--prompt", "Hi", "--chat",
                   "--max-new-tokens", "4"])
    assert rc == 0
    assert out.getvalue().strip(), "no text generated"
