"""bench.table: the performance table in one command, failing when any measure does not give its figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import table
from bench.table import Measure, Row

ROOT = Path(__file__).resolve().parent.parent


def _json_measure(name: str, path: Path, *rows: Row, clients: tuple[int, ...] = ()) -> Measure:
    """A measure whose command prints the JSON object in ``path`` on one line."""
    return Measure(name, lambda device, quick, counts: ["json.tool", "--compact", str(path)], rows,
                   (30.0, 30.0), clients=clients)


def _run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], measures: list[Measure],
         *args: str) -> tuple[int, dict]:
    monkeypatch.setattr(table, "_measures", lambda gpu: measures)
    rc = table.main(["--device", "cpu", "--json", *args])
    out = capsys.readouterr().out
    return rc, json.loads(out.strip().splitlines()[-1])


def test_every_key_found_gives_the_table_and_exit_0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"fraction_8": 0.5, "fraction_32": 0.75, "other": "x"}))
    measure = _json_measure("trunk", path, Row("fraction_{n}", "served / plain, {n} clients", ">= 0.8"),
                            clients=(8, 32))
    rc, result = _run(monkeypatch, capsys, [measure], "--out", str(tmp_path / "table.json"))
    assert rc == 0
    assert result["failed"] == [] and result["left_out"] == {}
    assert json.loads((tmp_path / "table.json").read_text()) == result
    got = result["measures"]["trunk"]
    assert got["rc"] == 0 and got["missing"] == []
    assert got["keys"]["fraction_8"] == 0.5 and got["keys"]["fraction_32"] == 0.75
    assert got["command"].startswith("python -m json.tool")
    assert "CPU" in result["card"]


def test_a_missing_key_a_failed_command_or_a_budget_gap_fails_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"fraction_8": 0.5}))
    # One client count's key is not printed: the run fails and names it.
    missing = _json_measure("trunk", path, Row("fraction_{n}", "x"), clients=(8, 32))
    rc, result = _run(monkeypatch, capsys, [missing])
    assert rc == 1 and result["failed"] == ["trunk"]
    assert result["measures"]["trunk"]["missing"] == ["fraction_32"]
    # A command that fails.
    broken = Measure("broken", lambda d, q, c: ["bench.no_such_bench"], (Row("k", "x"),), (30.0, 30.0))
    rc, result = _run(monkeypatch, capsys, [broken])
    assert rc == 1 and result["failed"] == ["broken"] and result["measures"]["broken"]["rc"] != 0
    assert "No module named" in result["measures"]["broken"]["stderr_tail"]
    # A measure the budget leaves out (it takes about 60 s, 5 are left): nothing ran, and the table has a hole.
    long = Measure("trunk", lambda d, q, c: ["json.tool", "--compact", str(path)], (Row("fraction_8", "x"),),
                   (100.0, 100.0), expect_s=30.0)
    rc, result = _run(monkeypatch, capsys, [long], "--budget-s", "5")
    assert rc == 1 and "trunk" in result["left_out"] and result["measures"] == {}
    # With room for it, it runs.
    rc, result = _run(monkeypatch, capsys, [long], "--budget-s", "100")
    assert rc == 0 and result["left_out"] == {}


def test_a_measure_that_needs_more_gpus_than_the_host_has_is_left_out_without_failing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"k": 1.0}))
    replicas = Measure("replicas", lambda d, q, c: ["json.tool", "--compact", str(path)], (Row("k", "x"),),
                       (30.0, 30.0), gpus=2)
    rc, result = _run(monkeypatch, capsys, [replicas, _json_measure("other", path, Row("k", "x"))])
    assert rc == 0 and "replicas" in result["left_out"] and "other" in result["measures"]


def test_only_runs_the_measures_named_in_the_order_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"k": 1.0}))
    measures = [_json_measure(name, path, Row("k", "x")) for name in ("trunk", "generation", "channel")]
    monkeypatch.setattr(table, "_measures", lambda gpu: measures)
    assert table.main(["--only", "channel", "trunk", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(result["measures"]) == ["channel", "trunk"]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("quick", [False, True])
def test_the_tables_commands_are_the_benches_own(device: str, quick: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command is a bench module's, with arguments its own parser accepts and a model config it knows."""
    from bench import core
    from doc_commands import parse_module_args

    monkeypatch.setattr(core, "SPLIT_STEP", dict(core.SPLIT_STEP))  # set_split_step below writes into it
    for measure in table._measures(device == "cuda"):
        module, *argv = measure.argv(device, quick, measure.counts(quick))
        parse_module_args(module, argv)
        for option in ("--config", "--split-config"):
            if option in argv:
                core.set_split_step(argv[argv.index(option) + 1], option)
        if module == "bench.trunk":
            assert argv[argv.index("--clients") + 1:][:len(measure.counts(quick))] == \
                [str(n) for n in measure.counts(quick)]
    names = {m.name for m in table._measures(True)}
    assert names == {m.name for m in table._measures(False)}
    assert all(0 < m.expect_s <= m.limit_s[0] for m in table._measures(True))


@pytest.mark.slow
def test_the_quick_table_runs_every_measure_on_the_cpu() -> None:
    """The documented smoke run: every measure with tiny configurations (replicas left out: no GPUs here)."""
    done = subprocess.run([sys.executable, "-m", "bench.table", "--device", "cpu", "--quick", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["failed"] == [] and set(result["left_out"]) == {"replicas"}
    assert len(result["measures"]) == len(table._measures(False)) - 1
