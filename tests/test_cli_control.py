"""The ``splitfed`` command's control side: ``models list|load|unload|reload`` import neither torch nor
transformers (they answer in well under a second), and ``--log-level`` is taken before or after the subcommand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from splitfed.channel.server.trunkserver import TrunkServer
from splitfed.cli.main import build_parser
from splitfed.serving.spec import ModelSpec

TOKEN = "admin-" + "y" * 26
#: Modules a control command must not import: each takes from a tenth of a second (numpy) to seconds (torch,
#: transformers), and the server's own code pulls them in.
HEAVY = ("torch", "transformers", "numpy", "splitfed.split", "splitfed.channel.server.trunkserver", "splitfed.channel.server.handlers",
         "splitfed.channel.server.admin", "splitfed.serving.memory")


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])


def test_importing_the_command_and_building_its_parser_imports_nothing_heavy() -> None:
    result = _run_python("import sys\nfrom splitfed.cli.main import build_parser\nbuild_parser()\nimport splitfed, "
                         "splitfed.serving\n"
                         f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.fixture
def server():
    server = TrunkServer(models=[ModelSpec("mnist-cnn", name="cnn", cuts=(3, 6))], insecure=True,
                         admin_token=TOKEN).start()
    yield server
    server.stop(grace=0)


def test_models_commands_run_without_torch_or_transformers(server: TrunkServer, tmp_path: Path) -> None:
    """Every verb, end to end against a running server, in a process of its own: the modules it imported."""
    token = tmp_path / "admin.token"
    token.write_text(TOKEN)
    common = ["--server", server.address, "--admin-token-file", str(token)]
    verbs = [["models", "list", *common], ["models", "load", "mnist-cnn", "--name", "cnn2", "--cuts", "3,6", *common],
             ["models", "reload", "cnn2", *common], ["models", "unload", "cnn2", *common],
             ["models", "list", "--json", *common]]
    result = _run_python("import sys\nfrom splitfed.cli.main import main\n"
                         f"for argv in {verbs!r}:\n    assert main(argv) == 0, argv\n"
                         f"print('heavy:', sorted(m for m in {HEAVY!r} if m in sys.modules))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "heavy: []"
    assert "cnn2" in result.stdout and sorted(server.models()) == ["cnn"]  # the verbs did run


@pytest.mark.parametrize("argv", [["--log-level", "debug", "report", "x"], ["report", "--log-level", "debug", "x"],
                                  ["report", "x", "--log-level", "DEBUG"]])
def test_log_level_is_taken_before_or_after_the_subcommand(argv: list[str]) -> None:
    assert build_parser().parse_args(argv).log_level == "DEBUG"


def test_log_level_after_a_nested_subcommand_and_the_default() -> None:
    parser = build_parser()
    assert parser.parse_args(["models", "list", "--server", "h:1", "--log-level", "WARNING"]).log_level == "WARNING"
    assert parser.parse_args(["--log-level", "ERROR", "models", "list", "--server", "h:1"]).log_level == "ERROR"
    assert parser.parse_args(["report", "x"]).log_level == "INFO"


def test_log_level_after_the_subcommand_shows_the_traceback() -> None:
    """The command as a user runs it: the hint "--log-level DEBUG shows where" works where the option is put."""
    result = subprocess.run([sys.executable, "-m", "splitfed.cli", "report", "--log-level", "DEBUG", "/nonexistent"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "splitfed report: error: no history.json" in result.stderr
