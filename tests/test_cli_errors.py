"""The ``splitfed`` command's errors: one line that says what is wrong and what to do, exit status 1; the
traceback only with ``--log-level DEBUG``."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from splitfed.cli.main import build_parser, main

ERROR = "splitfed {}: error: "


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_line(capsys: pytest.CaptureFixture[str], command: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(ERROR.format(command)), err
    return lines[0]


def test_an_unknown_model_is_named_with_the_models_there_are(capsys) -> None:
    assert main(["serve", "--model", "smollm2-13m", "--insecure"]) == 1
    line = _one_line(capsys, "serve")
    assert "no model 'smollm2-13m' (did you mean 'smollm2-135m'?)" in line
    assert all(name in line for name in ("mnist-cnn", "tiny-gpt2", "smollm2-135m", "minilm-l6"))
    assert "--cuts" not in line


def test_generate_says_which_models_generate(capsys) -> None:
    assert main(["generate", "--model", "tiny-gpt2", "--prompt", "hi"]) == 1
    assert "tiny-gpt2 cannot generate text" in _one_line(capsys, "generate")


def test_a_trunk_server_that_is_down_gets_a_hint_to_start_one(capsys, tmp_path: Path) -> None:
    from llm_fixtures import save_tiny

    folder = save_tiny("gpt2", tmp_path / "tiny")
    capsys.readouterr()  # transformers' progress bar while saving
    port = _free_port()
    assert main(["generate", "--model", str(folder), "--cuts", "1,3", "--prompt", "hi", "--insecure",
                 "--trunk", f"127.0.0.1:{port}"]) == 1
    line = _one_line(capsys, "generate")
    assert "UNAVAILABLE" in line and f"is a trunk server running at 127.0.0.1:{port}?" in line
    assert "splitfed serve" in line


def test_report_of_a_folder_without_a_history(capsys, tmp_path: Path) -> None:
    assert main(["report", str(tmp_path)]) == 1
    assert f"no history.json at {tmp_path}" in _one_line(capsys, "report")


def test_serve_without_tls_or_insecure_fails_before_loading_anything(capsys) -> None:
    assert main(["serve", "--model", "mnist-cnn", "--port", "0"]) == 1
    assert _one_line(capsys, "serve") == ("splitfed serve: error: give --tls-cert and --tls-key (and --tls-client-ca "
                                          "for mutual TLS), or --insecure to serve plaintext")


def test_debug_adds_the_traceback_in_the_console_command() -> None:
    """The command as a user runs it (a process): exit status 1, the line, and with DEBUG the traceback."""
    result = subprocess.run([sys.executable, "-m", "splitfed.cli", "--log-level", "DEBUG", "report", "/nonexistent"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "splitfed report: error: no history.json" in result.stderr


@pytest.mark.parametrize(("command", "option", "default"), [("serve", "--port", "50051"),
                                                            ("generate", "--max-new-tokens", "64")])
def test_options_say_what_they_do_and_their_default(command: str, option: str, default: str) -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]  # noqa: SLF001
    text = " ".join(sub.format_help().split())
    assert f"{option} {option.lstrip('-').upper().replace('-', '_')} " in text
    assert f"(default: {default}" in text.split(option, 2)[2]
