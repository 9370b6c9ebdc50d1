"""The trunk throughput benchmarks' commands (``bench.trunk``, ``bench.trunk_runtime``, ``bench.timeline_plot``) run
on the CPU at a tiny size and exit 0 with their figures; the figures mean nothing (a shared machine, a tiny model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = "layers=3 hidden=32 heads=2 vocab=64 batch=1 seq=8"  # bench.core's SPLIT_STEP keys


def _bench(module: str, *args: str, timeout: float = 300) -> str:
    """``python -m <module> <args>`` from the repository root; returns its stdout, asserting exit code 0."""
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert done.returncode == 0, f"{module} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done.stdout


def test_bench_trunk_on_the_cpu(tmp_path: Path) -> None:
    """One run of the command with the engine's switches that need no second run: ``--switch-interval`` (set where
    the server starts, and reported) and ``--bring-early`` (the server brings a step's tensors as they come; its
    exactness is ``tests/test_early_bring.py``'s, its bench run at a size where tensors cross regions is slow)."""
    timeline = tmp_path / "timeline.json"
    results = json.loads(_bench("bench.trunk", "--device", "cpu", "--clients", "2", "--repeat", "1", "--steps", "2",
                                "--only", "one", "batched", "--config", TINY, "--timeline", str(timeline),
                                "--switch-interval", "0.0005", "--bring-early",
                                "--json").strip().splitlines()[-1])
    assert results["switch_interval_s"] == pytest.approx(0.0005) and results["bring_early"] is True
    assert results["trunk_examples_per_s_2_clients_cpu"] > 0 and results["trunk_batching_speedup_cpu"] > 0
    assert results["trunk_examples_per_s_2_clients_batched_cpu"] > 0
    assert timeline.stat().st_size > 0
    assert results["timeline_steps"] >= 1 and results["timeline_step_longest_ms"] >= results["timeline_step_median_ms"]
    # each call's way between a client and the engine, from the clients' marks and the server's
    assert 0 < results["timeline_hop_forward_sent_to_in_ms"] <= results["timeline_hop_forward_sent_to_in_p90_ms"]
    assert results["timeline_hop_backward_out_to_got_ms"] > 0 and results["timeline_hop_intake_gap_ms"] >= 0
    # the host's cores during the batched run, and those the clients and the server kept busy
    assert results["host_cores"] == os.cpu_count() and 0 < results["cpu_host_busy_2_batched_cpu"] <= 1
    assert results["cpu_clients_cores_2_batched_cpu"] > 0 and results["cpu_engine_cores_2_batched_cpu"] > 0
    assert results["cpu_front_ends_cores_2_batched_cpu"] == 0  # none were asked for
    # the engine's event loop and device thread, among the engine's process (counted in 10 ms ticks: 2 of slack
    # each end), and the loop's CPU per call
    loop, device = results["cpu_engine_loop_cores_2_batched_cpu"], results["cpu_engine_device_cores_2_batched_cpu"]
    seconds = 2 * 2 * 2 / results["trunk_requests_per_s_2_clients_batched_cpu"]  # 2 clients, 2 steps, 2 calls a step
    assert loop > 0 and device > 0
    assert (loop + device - results["cpu_engine_cores_2_batched_cpu"]) * seconds <= 0.04
    assert results["cpu_engine_loop_us_per_call_2_batched_cpu"] > 0


@pytest.mark.parametrize(("args", "says"), [
    (["--switch-interval", "-1"], "--switch-interval: give seconds above 0"),
    (["--engines", "3", "--clients", "2"], "every engine needs a client"),
    (["--clients", "1", "2", "--timeline", "t.json"], "--timeline records one run"),
])
def test_bench_trunk_refuses_what_it_cannot_run_before_anything_starts(args: list[str], says: str) -> None:
    done = subprocess.run([sys.executable, "-m", "bench.trunk", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2 and says in done.stderr


def test_cpu_use_counts_each_group_of_processes_and_threads() -> None:
    """A process spinning meanwhile counts about one core in its group, an idle one none, and a group that
    counted its own CPU what it reported; a thread of this process likewise, by its name."""
    import threading

    from bench.cpu_use import CpuUse

    spin = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\ntime.sleep(30)"
    busy = subprocess.Popen([sys.executable, "-c", spin])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    stop = threading.Event()

    def spinning() -> None:
        end = time.thread_time() + 0.4
        while time.thread_time() < end:
            pass
        stop.wait(30)

    threads = [threading.Thread(target=spinning, name="bench-spinner", daemon=True),
               threading.Thread(target=stop.wait, args=(30,), name="bench-sleeper", daemon=True)]
    try:
        for t in threads:
            t.start()
        use = CpuUse({"busy": [busy.pid], "idle": [idle.pid], "gone": [2 ** 22 + 7]},
                     {"spinner": ["bench-spinner"], "sleeper": ["bench-sleeper"], "none": ["no-such-thread"]}
                     ).start()
        began = time.perf_counter()
        time.sleep(1.5)
        figures = use.stop(time.perf_counter() - began, reported=0.75)
    finally:
        stop.set()
        idle.kill()
        busy.kill()
    assert figures["cores"] == os.cpu_count() and 0 < figures["host_busy"] <= 1
    assert figures["busy_cores"] > 0.1 and figures["idle_cores"] < 0.05 and figures["gone_cores"] == 0
    assert 0.4 < figures["reported_cores"] < 0.6
    assert figures["spinner_cores"] > 0.05 and figures["sleeper_cores"] < 0.02 and figures["none_cores"] == 0


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a core for the clients and one for the server")
def test_bench_trunk_gives_clients_and_server_cores_of_their_own() -> None:
    """``--client-cores K`` pins the clients to K cores and the server to the rest; the output says so. (With
    ``--no-direct``: the server offers no direct calls, and the output says that too.)"""
    cores = len(os.sched_getaffinity(0))
    results = json.loads(_bench("bench.trunk", "--device", "cpu", "--clients", "2", "--repeat", "1", "--steps", "2",
                                "--only", "batched", "--client-cores", "1", "--no-direct", "--config", TINY,
                                "--json").strip().splitlines()[-1])
    assert results["client_cores"] == 1 and results["server_cores"] == cores - 1
    assert results["direct_calls"] is False
    assert results["trunk_examples_per_s_2_clients_batched_cpu"] > 0


@pytest.mark.slow  # the flag: test_bench_trunk_on_the_cpu; bringing early exactly: tests/test_early_bring.py
def test_bench_trunk_bringing_tensors_early() -> None:
    """``--bring-early``: the server brings a step's tensors as they come (tensors of 64 KiB: they arrive in host
    memory through the clients' regions); the run ends with its figures and says so."""
    config = "layers=3 hidden=64 heads=2 vocab=64 batch=1 seq=256"
    out = _bench("bench.trunk", "--device", "cpu", "--clients", "4", "--repeat", "1", "--steps", "2", "--only",
                 "batched", "--bring-early", "--json", "--config", config)
    results = json.loads(out.strip().splitlines()[-1])
    assert results["bring_early"] is True
    assert results["trunk_examples_per_s_4_clients_batched_cpu"] > 0


@pytest.mark.slow  # test_bench_trunk_on_the_cpu sets it, test_bench_trunk_refuses_... the negative one
def test_bench_trunk_sets_the_engines_switch_interval_and_refuses_a_negative_one() -> None:
    out = _bench("bench.trunk", "--device", "cpu", "--clients", "2", "--repeat", "1", "--steps", "2", "--only",
                 "batched", "--switch-interval", "0.0005", "--json", "--config", TINY)
    results = json.loads(out.strip().splitlines()[-1])
    assert results["switch_interval_s"] == pytest.approx(0.0005)
    assert results["trunk_examples_per_s_2_clients_batched_cpu"] > 0
    done = subprocess.run([sys.executable, "-m", "bench.trunk", "--switch-interval", "-1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "--switch-interval: give seconds above 0" in done.stderr


def test_bench_trunk_runtime(tmp_path: Path) -> None:
    """Each step's forwards in 2 batches, with a Chrome trace of one step (the plain run: the slow test below)."""
    trace = tmp_path / "step.json"
    results = json.loads(_bench("bench.trunk_runtime", "--clients", "3", "--steps", "1", "--batches", "2",
                                "--trace", str(trace), "--config", TINY, "--json").strip().splitlines()[-1])
    assert results["runtime_ceiling_fraction_3_in_2"] > 0
    assert json.loads(trace.read_text())["traceEvents"]  # a Chrome trace of one step
    assert "trace_gpu_busy_ms" not in results  # no GPU in it to read (bench.gpu_gaps reads GPU traces)


@pytest.mark.slow
def test_bench_trunk_runtime_all_forwards_in_one_batch() -> None:
    results = json.loads(_bench("bench.trunk_runtime", "--clients", "2", "--steps", "1", "--config", TINY,
                                "--json").strip().splitlines()[-1])
    assert results["runtime_ceiling_fraction_2"] > 0


@pytest.mark.slow
def test_bench_trunk_with_compiled_blocks() -> None:
    """``--compile``: the server's blocks compiled, and the ceiling with the same compiled blocks beside the plain
    one."""
    results = json.loads(_bench("bench.trunk", "--device", "cpu", "--clients", "2", "--repeat", "1", "--steps", "2",
                                "--only", "batched", "ceiling", "--compile", "--config", TINY,
                                "--json", timeout=900).strip().splitlines()[-1])
    assert results["compile"] is True
    assert results["trunk_ceiling_fraction_2_cpu"] > 0 and results["trunk_ceiling_fraction_2_vs_compiled_cpu"] > 0


@pytest.mark.parametrize("recording", ["trunk_timeline_after.json", "trunk_timeline_compiled.json"])
def test_bench_timeline_plot(tmp_path: Path, recording: str) -> None:
    """The commands of docs/performance.md that draw its committed timelines."""
    pytest.importorskip("matplotlib")
    _bench("bench.timeline_plot", str(ROOT / "docs" / "img" / recording), str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 0


@pytest.mark.slow  # the sync run: test_bench_trunk_on_the_cpu; async and quorum trunks: test_reliability.py
@pytest.mark.parametrize("mode", ["async", "quorum"])
def test_bench_trunk_in_other_modes(mode: str) -> None:
    """``--mode`` runs the batched clients against an async or quorum trunk; its keys carry the mode. Two counts of
    clients are measured in turn."""
    results = json.loads(_bench("bench.trunk", "--device", "cpu", "--clients", "1", "2", "--repeat", "1",
                                "--steps", "2", "--only", "batched", "--mode", mode, "--window-ms", "5",
                                "--config", TINY,
                                "--json").strip().splitlines()[-1])
    assert results[f"trunk_examples_per_s_2_clients_batched_{mode}_cpu"] > 0 and results["mode"] == mode
    assert results[f"trunk_examples_per_s_1_clients_batched_{mode}_cpu"] > 0


@pytest.mark.slow
def test_bench_trunk_replicas_time_the_control_loop(tmp_path: Path) -> None:
    """``--replicas 2`` (docs/replicas.md; gloo processes on the CPU) gives the scaling and, with ``--timeline``,
    replica 0's control loop: its ticks a step and its way from its gradients in to its step."""
    timeline = tmp_path / "timeline.json"
    results = json.loads(_bench("bench.trunk", "--device", "cpu", "--replicas", "2", "--clients", "2", "--repeat",
                                "1", "--steps", "3", "--only", "batched", "--config", TINY, "--timeline",
                                str(timeline), "--json").strip().splitlines()[-1])
    assert results["replica_scaling_2proc_cpu"] > 0 and timeline.stat().st_size > 0
    assert results["timeline_replica_ticks_per_step"] >= 1 and "timeline_replica_vetoes" in results
    assert 0 < results["timeline_hop_replica_ready_wait_ms"] <= results["timeline_hop_replica_ready_to_step_ms"]


@pytest.mark.slow  # its refusal: test_bench_trunk_refuses_what_it_cannot_run_before_anything_starts
def test_bench_trunk_engines_serve_their_own_clients_beside_the_first(tmp_path: Path) -> None:
    """``--engines 2``: a second engine in a process of its own (with its front-end) takes half the clients (the
    first engine's timeline holds one client's calls a step, not two), and the scaling is reported; more engines
    than clients is refused before anything starts."""
    timeline = tmp_path / "timeline.json"
    results = json.loads(_bench("bench.trunk", "--device", "cpu", "--engines", "2", "--clients", "2", "--repeat",
                                "1", "--steps", "3", "--only", "batched", "--frontends", "1", "--config", TINY,
                                "--timeline",
                                str(timeline), "--json").strip().splitlines()[-1])
    assert results["engine_scaling_2_cpu"] > 0 and results["trunk_examples_per_s_2_clients_batched_2engines_cpu"] > 0
    assert results["timeline_forward_in_count"] == 1 and results["timeline_backward_in_count"] == 1
    done = subprocess.run([sys.executable, "-m", "bench.trunk", "--engines", "3", "--clients", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "every engine needs a client" in done.stderr


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(port: int, *args: str) -> subprocess.Popen[str]:
    """``bench.trunk --serve`` on ``port``, once it says that it serves (as a user waits for it)."""
    server = subprocess.Popen([sys.executable, "-m", "bench.trunk", "--serve", f"127.0.0.1:{port}", "--clients", "2",
                               "--steps", "2", "--config", TINY, "--json", *args], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    assert server.stderr is not None
    for line in server.stderr:
        if "serving at" in line:
            return server
    server.kill()
    raise AssertionError(f"bench.trunk --serve ended without serving: {server.communicate()}")


@pytest.mark.slow
def test_bench_trunk_with_its_clients_started_elsewhere() -> None:
    """``--serve`` and ``--connect`` (the two hosts of docs/performance.md, here on one): both sides exit 0; the
    server side (with a front-end process, as the command line asks) prints the batched keys and the ceiling, the
    client side what its clients saw."""
    port = _free_port()
    server = _serve(port, "--only", "batched", "ceiling", "--frontends", "1")
    try:
        clients = json.loads(_bench("bench.trunk", "--connect", f"127.0.0.1:{port}", "--clients", "2", "--steps", "2",
                                    "--config", TINY, "--json").strip().splitlines()[-1])
        out, err = server.communicate(timeout=300)
    finally:
        server.kill()
    assert server.returncode == 0, err[-4000:]
    served = json.loads(out.strip().splitlines()[-1])
    assert served["trunk_examples_per_s_2_clients_batched_cpu"] > 0 and served["trunk_ceiling_fraction_2_cpu"] > 0
    assert served["clients"] == clients["clients"] == "remote" and served["frontends"] == 1
    assert clients["client_examples_per_s_2_clients"] > 0


def test_bench_trunk_clients_elsewhere_that_fail_fail_both_sides() -> None:
    """Clients whose activations the trunk cannot take (another hidden size) exit non-zero, and so does the
    server side, saying that its clients failed: no figure is printed for a run that did not happen."""
    port = _free_port()
    server = _serve(port, "--only", "batched")
    try:
        done = subprocess.run([sys.executable, "-m", "bench.trunk", "--connect", f"127.0.0.1:{port}", "--clients", "2",
                               "--steps", "2", "--config", TINY.replace("hidden=32", "hidden=16")], cwd=ROOT,
                              capture_output=True, text=True, timeout=300, check=False)
        out, err = server.communicate(timeout=300)
    finally:
        server.kill()
    assert done.returncode == 1 and "INVALID_ARGUMENT" in done.stderr, done.stderr[-4000:]
    assert server.returncode == 1 and "the clients left after 0 of 4 sync steps" in err, err[-4000:]
    assert "trunk_examples_per_s" not in out


def test_bench_kernel_diff_lists_what_the_server_runs_beside_the_ceiling() -> None:
    results = json.loads(_bench("bench.kernel_diff", "--clients", "2", "--steps", "1", "--config", TINY,
                                "--json").strip().splitlines()[-1])
    assert results["kernel_diff_served_cpu_ms"] > 0 and results["kernel_diff_ceiling_cpu_ms"] > 0
    assert results["kernel_diff_rows"] and all(len(row) == 5 for row in results["kernel_diff_rows"])


def test_kernel_diff_sums_each_sides_device_events_per_step_and_puts_the_servers_extra_first() -> None:
    from bench.kernel_diff import diff, table

    def event(name: str, dur: float, cat: str = "kernel") -> dict:
        return {"ph": "X", "ts": 0.0, "dur": dur, "name": name, "cat": cat}

    served = table([event("gemm", 100), event("gemm", 100), event("cast", 30), event("cast", 30),
                    event("Memcpy HtoD", 50, "gpu_memcpy"), event("aten::mm", 999, "cpu_op")], steps=2)
    ceiling = table([event("gemm", 200), event("gemm", 200)], steps=2)
    assert served == {"gemm": (1.0, 100.0), "cast": (1.0, 30.0), "Memcpy HtoD": (0.5, 25.0)}
    rows = diff(served, ceiling)
    assert [r.name for r in rows] == ["cast", "Memcpy HtoD", "gemm"]  # the server's extra first, its saving last
    assert rows[0].ceiling_calls == 0 and rows[-1].extra_us == -100.0
