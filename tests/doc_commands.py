"""Checking the shell, TOML and YAML blocks of README.md and docs/ as a reader would meet them.

Each command line of a shell block is split as a POSIX shell would (continuation lines joined, comments dropped,
``&&``, ``;``, ``|`` and ``&`` separating commands, a heredoc's lines kept as a file it writes) and then checked by
the program it names, with that program's own parser and without starting anything long-lived:

- ``splitfed ...``: ``splitfed.cli.main.build_parser().parse_args``; ``--help`` runs.
- ``flwr ...``: Flower's own click command parses the options; every ``--run-config`` key must exist in
  pyproject's ``[tool.flwr.app.config]`` with a value of a compatible type.
- ``flower-superlink`` / ``flower-supernode``: Flower's argparse parsers; ``--node-config`` keys must be ones the
  apps read.
- ``python -m MODULE ARGS``: the module must exist and its ``ArgumentParser`` must accept ARGS (the module runs up
  to its ``parse_args`` and stops there); ``python FILE``: the file exists; ``python -m pytest PATHS``: the paths
  exist; :data:`RUN_MODULES` really run.
- ``pip install``: every extra named exists in pyproject.
- ``openssl``: runs in the document's scratch folder (keys and certificates take a moment); what ``-out`` and
  ``-keyout`` name is made.
- files and folders named must exist in the repository or be made earlier in the same document (an output option
  such as ``--out``, a ``>``, ``mkdir``, a heredoc, or a command that really ran).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import runpy
import shlex
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from doc_blocks import ROOT

#: Programs of a shell block that are the shell's own business (nothing to check beyond the paths they make).
SHELL = {"export", "mkdir", "cd", ".", "source", "cat", "echo", "grep"}
#: Programs that cannot be checked here at all: a block using one must be on the test's not-checked list.
UNCHECKABLE = {"apt-get": "installs system packages", "curl": "needs a running server"}
#: Modules ``python -m`` really runs here, in the document's scratch folder.
RUN_MODULES = {"splitfed.models.tiny_llama"}
#: Options whose value is a file or folder the command writes.
OUTPUT_OPTIONS = {"--out", "--plot", "--timeline", "--trace", "--plots-dir", "--database", "--output-dir"}
#: Placeholders a document writes for a value of the reader's choosing, and what the check puts in their place.
PLACEHOLDERS = {"N": "8", "TRUNK_HOST:50061": "127.0.0.1:50061"}
#: Keys a SuperNode's ``--node-config`` may set: Flower's partition keys and those ``splitfed.config`` reads.
_PATH = re.compile(r"^(\./)?[\w.+-]+(/[\w.+-]*)*$")
_FILE_SUFFIXES = {".py", ".md", ".json", ".png", ".toml", ".pem", ".key", ".token", ".txt", ".yml", ".yaml",
                  ".db", ".jsonl", ".csv", ".safetensors", ".pt"}


def node_config_keys() -> set[str]:
    from splitfed.config import NODE_KEYS
    from splitfed.models.hetero import NODE_CUTS_KEY

    return {"partition-id", "num-partitions", NODE_CUTS_KEY, *NODE_KEYS}


def app_config() -> dict[str, Any]:
    """pyproject's ``[tool.flwr.app.config]``, flattened as Flower flattens it."""
    from flwr.common.config import flatten_dict

    return flatten_dict(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"])


def extras() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def check_app_keys(values: dict[str, Any], where: str) -> None:
    """Every key of ``values`` is an app config key, with a value of the default's type (an int may stand for a
    float)."""
    known = app_config()
    unknown = sorted(set(values) - set(known))
    assert not unknown, f"{where}: keys {unknown} are not in pyproject's [tool.flwr.app.config]"
    for key, value in values.items():
        want = type(known[key])
        ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
        ok = ok or (want is float and isinstance(value, int) and not isinstance(value, bool))
        assert ok, f"{where}: {key}={value!r} is a {type(value).__name__}, the app expects a {want.__name__}"


# ---------------------------------------------------------------------------------------------- shell splitting


@dataclass
class Script:
    """The commands of a shell block and the files its heredocs write."""

    commands: list[list[str]] = field(default_factory=list)
    heredocs: dict[str, str] = field(default_factory=dict)  # target -> text


def _logical_lines(text: str) -> Iterator[str]:
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        while line.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        yield line


def split_script(text: str, prompt_only: bool = False) -> Script:
    """The commands of ``text`` (with ``prompt_only``, only the lines after a ``$ `` prompt: the rest is output)."""
    script = Script()
    lines = list(_logical_lines(text))
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if prompt_only:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        heredoc = re.search(r"<<-?\s*'?\"?(\w+)'?\"?", line)
        if heredoc:  # the heredoc's body is the file the command writes
            end = next(j for j in range(i, len(lines)) if lines[j].strip() == heredoc.group(1))
            target = re.search(r">\s*(\S+)", line)
            if target:
                script.heredocs[target.group(1)] = "\n".join(lines[i:end]) + "\n"
            line = line[:heredoc.start()]
            i = end + 1
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        command: list[str] = []
        for token in lexer:
            if token in {";", "&", "&&", "|", "||"}:
                if command:
                    script.commands.append(command)
                command = []
            else:
                command.append(token)
        if command:
            script.commands.append(command)
    return script


# ---------------------------------------------------------------------------------------------- checking


def _optional(token: str) -> str:
    if token.startswith("[--"):
        token = token[1:]
    while token.count("]") > token.count("["):
        token = token[:-1]
    return token


class Failed(AssertionError):
    """A command a document shows does not parse or names something missing."""


@contextlib.contextmanager
def _parser_output() -> Iterator[io.StringIO]:
    out = io.StringIO()
    with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
        yield out


def _argparse(parser: argparse.ArgumentParser, argv: list[str], what: str) -> argparse.Namespace:
    with _parser_output() as out:
        try:
            return parser.parse_args(argv)
        except SystemExit as exc:
            if exc.code == 0:  # --help
                return argparse.Namespace()
            raise Failed(f"{what}: {out.getvalue().strip()}") from None


class _Parsed(BaseException):
    """Raised by a patched ``parse_args`` once a module's arguments parsed."""


def parse_module_args(module: str, argv: list[str]) -> None:
    """Run ``python -m module argv`` up to its first ``ArgumentParser.parse_args`` and stop there."""
    import importlib.util

    if str(ROOT) not in sys.path:  # python -m from the repository's root, as the documents run it
        sys.path.insert(0, str(ROOT))
    try:
        found = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        found = None
    if found is None:
        raise Failed(f"python -m {module}: no such module")
    original = argparse.ArgumentParser.parse_args

    def parse_args(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        original(self, args, namespace)
        raise _Parsed

    saved = sys.argv
    sys.argv = [module, *argv]
    argparse.ArgumentParser.parse_args = parse_args  # type: ignore[method-assign]
    try:
        with _parser_output() as out:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except _Parsed:
        return
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise Failed(f"python -m {module} {shlex.join(argv)}: {out.getvalue().strip()[-600:]}") from None
        return
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
        sys.argv = saved
    raise Failed(f"python -m {module}: ran to the end without parsing arguments")


def _click_parse(argv: list[str]) -> dict[str, Any]:
    import click
    import typer
    from flwr.cli.app import app

    group = typer.main.get_command(app)
    name, rest = argv[0], argv[1:]
    with _parser_output() as out:
        try:
            with group.make_context("flwr", [name, *rest]) as ctx:
                command = group.get_command(ctx, name)
                if command is None:
                    raise Failed(f"flwr {name}: no such command")
                return command.make_context(name, list(rest), parent=ctx).params
        except click.exceptions.Exit:
            return {}
        except click.ClickException as exc:
            raise Failed(f"flwr {shlex.join(argv)}: {exc.format_message()} {out.getvalue()[-300:]}") from None


@dataclass
class Checker:
    """Checks one document's commands in order; ``made`` holds the paths earlier commands wrote."""

    doc: str
    scratch: Path
    made: set[str] = field(default_factory=set)
    connections: set[str] = field(default_factory=lambda: {"local"})  # flwr's own, and those a heredoc writes
    ran: list[str] = field(default_factory=list)  # commands that really ran

    # ------------------------------------------------------------------ paths
    def _norm(self, path: str) -> str:
        return os.path.normpath(path)

    def _exists(self, path: str) -> bool:
        norm = self._norm(path)
        return (norm in self.made or any(norm.startswith(m + os.sep) for m in self.made)
                or (ROOT / norm).exists() or (self.scratch / norm).exists())

    def add_heredocs(self, heredocs: dict[str, str]) -> None:
        """Files a block's heredocs write; a Flower ``config.toml`` among them adds its connections."""
        self.made.update(self._norm(target) for target in heredocs)
        for target, text in heredocs.items():
            if target.endswith("config.toml"):
                self.connections.update(k for k in tomllib.loads(text).get("superlink", {}) if k != "default")

    def _paths(self, argv: list[str]) -> None:
        """Files named by ``argv`` exist or were made earlier; what an output option names is made now."""
        output_next = False
        for token in argv[1:]:
            if output_next:
                self.made.add(self._norm(token))
                output_next = False
                continue
            if token in OUTPUT_OPTIONS or token == ">":
                output_next = True
                continue
            option, _, value = token.partition("=") if token.startswith("--") else ("", "", token)
            if option in OUTPUT_OPTIONS:
                self.made.add(self._norm(value))
                continue
            if not value or value.startswith(("-", "/", "$")) or not _PATH.match(value):
                continue
            suffix = Path(value).suffix
            if not (value.startswith("./") or "/" in value or suffix in _FILE_SUFFIXES):
                continue
            if "/" not in value and suffix in {".png", ".svg", ".pdf"}:  # a plot the command writes
                self.made.add(self._norm(value))
                continue
            if not self._exists(value):
                raise Failed(f"{shlex.join(argv)}: {value} does not exist and no earlier command of {self.doc} makes it")

    # ------------------------------------------------------------------ programs
    def check(self, argv: list[str]) -> str:
        """Check (or run) one command; returns "ran" or "checked". Raises :class:`Failed`."""
        outcome = self._check(argv)
        if outcome == "ran":
            self.ran.append(shlex.join(argv))
        return outcome

    def _check(self, argv: list[str]) -> str:
        while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):  # VAR=value command
            argv = argv[1:]
        if argv and argv[0] == "sudo":
            argv = argv[1:]
        argv = [PLACEHOLDERS.get(token, token) for token in argv]
        argv = [_optional(token) for token in argv]  # "[--compile]": an optional part, checked as given
        program = argv[0]
        if program in SHELL:
            if program == "mkdir":
                self.made.update(self._norm(p) for p in argv[1:] if not p.startswith("-"))
            if program in {".", "source"} and not self._exists(argv[1]):
                raise Failed(f"{shlex.join(argv)}: {argv[1]} does not exist")
            return "checked"
        if program in UNCHECKABLE:
            raise Failed(f"{program} cannot be checked here ({UNCHECKABLE[program]}): list the block as not checked")
        if program == "splitfed":
            return self._splitfed(argv)
        if program == "flwr":
            return self._flwr(argv)
        if program in {"flower-superlink", "flower-supernode"}:
            return self._flower(argv)
        if Path(program).name in {"python", "python3"}:
            return self._python(argv)
        if program in {"pip", "pip3"}:
            return self._pip(argv)
        if program == "openssl":
            return self._openssl(argv)
        raise Failed(f"{shlex.join(argv)}: no check knows {program!r}; add one to tests/doc_commands.py")

    def _splitfed(self, argv: list[str]) -> str:
        from splitfed.cli.main import build_parser

        self._paths(argv)
        _argparse(build_parser(), argv[1:], shlex.join(argv))
        if "--help" in argv or "-h" in argv:
            return "ran"
        return "checked"

    def _flwr(self, argv: list[str]) -> str:
        from flwr.common.config import parse_config_args

        params = _click_parse(argv[1:])
        for i, token in enumerate(argv):
            if token in {"--run-config", "--federation-config", "--node-config"} and i + 1 < len(argv):
                try:
                    values = parse_config_args([argv[i + 1]])
                except Exception as exc:  # noqa: BLE001 - Flower's parse error, reported as the doc's
                    raise Failed(f"{shlex.join(argv)}: {token} does not parse: {exc}") from None
                if token == "--run-config":
                    check_app_keys(values, shlex.join(argv))
        app = params.get("app")
        if argv[1] == "run" and app:
            assert (ROOT / str(app) / "pyproject.toml").exists(), f"{shlex.join(argv)}: no app at {app}"
        name = params.get("superlink")
        if name:
            assert name in self.connections, f"{shlex.join(argv)}: no connection {name!r} (known: {self.connections})"
        return "checked"

    def _flower(self, argv: list[str]) -> str:
        import importlib

        from flwr.common.config import parse_config_args

        argv = [token for token in argv if token != "..."]  # "..." elides options the document showed before
        if argv[0] == "flower-superlink":
            parser = importlib.import_module("flwr.superlink.cli.flower_superlink")._parse_args_run_superlink()
        else:
            parser = importlib.import_module("flwr.supernode.cli.flower_supernode")._parse_args_run_supernode()
        self._paths(argv)
        args = _argparse(parser, argv[1:], shlex.join(argv))
        node_config = getattr(args, "node_config", None)
        if node_config:
            keys = set(parse_config_args([node_config]))
            unknown = sorted(keys - node_config_keys())
            assert not unknown, f"{shlex.join(argv)}: node-config keys {unknown} are read by no app"
        return "checked"

    def _python(self, argv: list[str]) -> str:
        args = argv[1:]
        if args and args[0] == "-c":  # runs, its stdout into the file after ">" (in the scratch folder)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(args[1], "python -c", "exec"), {"__name__": "__main__"})  # noqa: S102 - the doc's code
            if ">" in args:
                target = args[args.index(">") + 1]
                (self.scratch / target).write_text(out.getvalue())
                self.made.add(self._norm(target))
            return "ran"
        if not args or args[0] != "-m":
            script = args[0]
            assert (ROOT / script).exists(), f"{shlex.join(argv)}: {script} does not exist"
            return "checked"
        module, rest = args[1], args[2:]
        if module == "pytest":
            valued = {"-m", "-k", "-p", "-o", "-c", "-n", "--dist", "--timeout", "--rootdir"}  # options whose value follows them
            for before, path in zip(["", *rest], rest):
                if not path.startswith("-") and before not in valued:
                    assert (ROOT / path.split("::")[0]).exists(), f"{shlex.join(argv)}: {path} does not exist"
            return "checked"
        if module == "venv" and rest:  # makes the environment a later ". .venv/bin/activate" reads
            self.made.add(self._norm(rest[-1]))
        if module in RUN_MODULES:
            self._run_module(module, rest)
            return "ran"
        self._paths(argv)
        parse_module_args(module, rest)
        return "checked"

    def _run_module(self, module: str, argv: list[str]) -> None:
        saved_argv, saved_cwd = sys.argv, os.getcwd()
        sys.argv = [module, *argv]
        os.chdir(self.scratch)
        try:
            with _parser_output() as out:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise Failed(f"python -m {module} {shlex.join(argv)} exited {exc.code}: {out.getvalue()[-600:]}")
        finally:
            sys.argv = saved_argv
            os.chdir(saved_cwd)
        self.made.update(self._norm(a) for a in argv if not a.startswith("-") and (self.scratch / a).exists())

    def _openssl(self, argv: list[str]) -> str:
        import shutil
        import subprocess

        made = [argv[i + 1] for i, token in enumerate(argv[:-1]) if token in ("-out", "-keyout")]
        if shutil.which("openssl") is None:  # nothing to run it with here: its outputs count as made, unchecked
            self.made.update(self._norm(path) for path in made)
            return "checked"
        result = subprocess.run(argv, cwd=self.scratch, capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise Failed(f"{shlex.join(argv)} exited {result.returncode}: {result.stderr.strip()[-600:]}")
        missing = [path for path in made if not (self.scratch / path).exists()]
        if missing:
            raise Failed(f"{shlex.join(argv)}: made no {', '.join(missing)}")
        self.made.update(self._norm(path) for path in made)
        return "ran"

    def _pip(self, argv: list[str]) -> str:
        known = extras()
        for token in argv[2:]:
            match = re.match(r"^(\.|splitfed)\[([\w,\s-]+)\]$", token)
            if match:
                missing = {e.strip() for e in match.group(2).split(",")} - known
                assert not missing, f"{shlex.join(argv)}: extras {sorted(missing)} are not in pyproject"
        return "checked"


# ---------------------------------------------------------------------------------------------- other blocks


def check_toml(text: str, where: str) -> None:
    """A models file (``[models.NAME]`` tables) loads with ``splitfed serve``'s reader; other TOML is app config."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise Failed(f"{where}: not valid TOML: {exc}") from None
    if "models" in doc:
        from splitfed.serving.spec import read_models_file

        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "models.toml"
            path.write_text(text)
            read_models_file(path)
        return
    check_app_keys(doc, where)


def check_yaml(text: str, where: str) -> None:
    import yaml

    try:
        yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise Failed(f"{where}: not valid YAML: {exc}") from None

