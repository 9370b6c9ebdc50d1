"""Every benchmark's command runs, at a tiny size, and exits 0 with its figures; a benchmark whose process dies
fails at once instead of waiting. The figures of these runs mean nothing (the machine is shared and the models
tiny): only that each command works end to end is checked. ``tests/test_wan_bench.py`` smoke-tests
``bench.wan`` (it needs network namespaces), ``tests/test_bench_smoke_trunk.py`` the trunk throughput benchmarks."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.processes import BenchError, get_from

ROOT = Path(__file__).resolve().parent.parent


def _bench(module: str, *args: str, timeout: float = 540) -> str:
    """``python -m <module> <args>`` from the repository root; returns its stdout, asserting exit code 0."""
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert done.returncode == 0, f"{module} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done.stdout


def _json(stdout: str) -> dict:
    """The last JSON object a bench printed (one line, or indented)."""
    start = stdout.rfind("\n{") + 1 if stdout.rstrip().endswith("}") else -1
    assert start >= 0, stdout[-2000:]
    return json.loads(stdout[start:])


# -- in-process and multi-process benchmarks ---------------------------------------------------------------
def test_bench_suites() -> None:
    results = _json(_bench("bench", "--quick", "--json"))
    for key in ("split_step_ratio", "split_step_ratio_process", "channel_vs_grpc_ratio_4KiB",
                "channel_direct_vs_grpc_ratio_4KiB",
                "codec_speedup_vs_repeated_float", "compression_bytes_ratio_int8", "gen_bytes_per_token_cache",
                "gen_batched_speedup"):
        assert results[key] > 0, key
    assert results["gen_greedy_match"] == 1.0 and results["gen_batched_greedy_match"] == 1.0
    # generation with the trunk server in a process of its own: the same tokens, and its latency timed
    assert results["gen_greedy_match_process"] == 1.0 and results["gen_latency_ratio_process"] > 0
    # a client on the trunk's host sends every call of a generation over its region's direct-call link
    assert results["gen_direct_share"] == 1.0 and results["gen_direct_share_process"] == 1.0
    # bench.generation's and bench.gen_batching's own figures, at the sizes of their commands below (slow)
    assert results["gen_bytes_per_token_nocache"] > 0 and results["gen_batched_sessions"] == 2.0
    assert results["gen_replay_batched_speedup"] > 0 and results["gen_replay_batched_mean_batch"] >= 1.0
    # the trunk alone prefilled the sessions in one call, and that call was timed
    assert results["gen_trunk_prefill_speedup"] > 0 and "gen_batched_prefills" in results
    # each generating client's own work per token, and the speedup it allows
    assert results["gen_client_ms_per_token"] > 0 and results["gen_client_bound_speedup"] > 0
    # the cores the batched server's event loop and device thread kept busy
    assert results["gen_engine_loop_cores"] > 0 and results["gen_replay_engine_device_cores"] > 0
    # and the event loop's CPU per session step: more than nothing, less than the whole run a call
    assert 0 < results["gen_engine_loop_us_per_call"] < 1e6 and results["gen_replay_engine_loop_us_per_call"] > 0
    # and the loop's turns per session step: counted, and a few a call, not dozens
    assert 0 < results["gen_engine_loop_turns_per_call"] < 20 and results["gen_replay_engine_loop_turns_per_call"] > 0
    assert 0 <= results["gen_direct_share"] <= 1 and 0 <= results["gen_replay_direct_share"] <= 1


def test_bench_load() -> None:
    results = _json(_bench("bench.load", "--clients", "2", "--steps", "3", "--json"))
    assert results["steps_done"] == 6 and results["errors"] == 0 and results["server_rss_peak_mib"] > 0


@pytest.mark.slow  # CI: get_from's own test below (a process that ended having sent nothing fails the wait at once)
def test_bench_load_fails_at_once_when_its_server_process_dies() -> None:
    """The server process raises at start (an unknown trunk mode): the bench says so within seconds, instead of
    waiting for a port that will never come."""
    from bench.load import run

    with pytest.raises(BenchError, match="ended with exit code 1"):
        run(clients=1, steps=1, mode="no-such-mode")


def _exit_with(code: int, put: object, delay_s: float, queue: object) -> None:
    time.sleep(delay_s)
    if put is not None:
        queue.put(put)  # type: ignore[attr-defined]
    raise SystemExit(code)


def test_get_from_returns_what_a_process_sent_before_it_ended_and_fails_when_it_sent_nothing() -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    for put, code in (("port 1234", 0), (None, 3)):
        queue = ctx.Queue()
        proc = ctx.Process(target=_exit_with, args=(code, put, 0.5, queue))
        proc.start()
        try:
            if put is None:
                with pytest.raises(BenchError, match=f"process {proc.pid} ended with exit code 3"):
                    get_from(queue, [proc], 300, "the port")
            else:
                proc.join(60)  # it has ended before the wait starts: what it sent still counts
                assert get_from(queue, [proc], 300, "the port") == put
        finally:
            proc.join(60)
    with pytest.raises(BenchError, match="nothing within 1 s"):
        get_from(ctx.Queue(), [], 1, "a reply")


def test_bench_transport() -> None:
    results = _json(_bench("bench.transport", "--mib", "0.25", "--repeat", "1", "--json"))
    assert results["transport_bytes"] == 1 << 18
    for key in ("transport_grpc_unary_ms", "transport_grpc_stream_ms", "transport_grpc_channels4_ms",
                "transport_tcp_ms", "transport_tcp_conns4_ms", "transport_grpc_stream_vs_tcp",
                "transport_bulk_link4_ms", "transport_bulk_vs_grpc_stream"):
        assert results[key] > 0, key


@pytest.mark.slow
def test_bench_split_step_over_a_bulk_link() -> None:
    # 512 KiB at the cut: every Forward and Backward streams over the link (above BULK_MIN_BYTES), plaintext and
    # TLS (a TLS channel with a TLS link); int8 at the cut (docs/performance.md's command), still above it.
    results = _json(_bench("bench", "--quick", "--only", "split_step", "--transports", "bulk", "tls", "bulk-tls",
                           "--wire-compression", "int8", "--json", "--split-config",
                           "layers=4 hidden=128 heads=2 vocab=256 batch=4 seq=512"))
    assert results["split_step_wire_compression"] == "int8"
    for key in ("split_step_ratio_bulk", "split_step_ratio_process_bulk", "split_step_ratio_tls",
                "split_step_ratio_process_tls", "split_step_ratio_bulk_tls", "split_step_ratio_process_bulk_tls"):
        assert results[key] > 0, key
    for suffix in ("bulk", "process_bulk", "bulk_tls", "process_bulk_tls"):
        assert results[f"split_step_bulk_fraction_{suffix}"] == 1.0, suffix


def test_bench_checkpointing() -> None:
    results = _json(_bench("bench.checkpointing", "--seq", "8", "--repeat", "1", "--config",
                           "layers=3 hidden=32 heads=2 vocab=64"))
    assert results["saved_bytes_ratio"] > 1


def test_bench_graph_turns_on_the_cpu_and_a_mode_that_cannot_run_fails_the_run() -> None:
    """One run: the eager mode's figures are printed, then the run fails for the mode that cannot run here."""
    done = subprocess.run([sys.executable, "-m", "bench.graph_turns", "--device", "cpu", "--modes", "eager", "graphed",
                           "--rows", "2", "--steps", "2", "--config", "layers=3 hidden=32 heads=2 vocab=64 seq=8",
                           "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1 and "graphed_2_error" in done.stdout and "CUDA graphs need a CUDA device" in done.stderr
    results = _json(done.stdout)
    assert results["eager_2_forward_ms"] > 0 and results["eager_2_backward_ms"] > 0
    assert results["eager_2_max_abs_diff"] == 0.0


def test_bench_contended_codec_times_the_codec_alone_and_beside_a_busy_thread() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.contended_codec", "--calls", "20", "--repeat", "1",
                           "--hidden", "64", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    results = _json(done.stdout)
    for dtype in ("fp32", "bf16"):
        quiet, contended = results[f"codec_step_quiet_us_{dtype}"], results[f"codec_step_contended_us_{dtype}"]
        assert quiet > 0 and contended > 0
        assert results[f"codec_step_contention_ratio_{dtype}"] == pytest.approx(contended / quiet)


@pytest.mark.parametrize(("module", "config", "says"), [
    ("bench.graph_turns", "nope=3", "--config: unknown key 'nope'"),
    ("bench.trunk", "layers=x", "--config: 'layers=x' needs an integer value"),
])
def test_a_bad_config_ends_a_bench_at_once_saying_what_is_wrong(module: str, config: str, says: str) -> None:
    done = subprocess.run([sys.executable, "-m", module, "--config", config], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 2 and says in done.stderr


@pytest.mark.slow  # test_bench_suites asserts these figures, from the same function at the same size
def test_bench_generation() -> None:
    results = _json(_bench("bench.generation", "--new-tokens", "4", "--prompt-len", "4", "--repeat", "1",
                           "--static-baseline", "--json"))
    assert results["gen_greedy_match"] == 1.0 and results["gen_bytes_per_token_nocache"] > 0
    assert results["gen_greedy_match_static"] == 1.0 and results["gen_latency_ratio_static"] > 0


def test_the_static_baseline_times_the_unsplit_model_over_a_static_cache(monkeypatch) -> None:
    from bench import generation as bench_generation

    model = bench_generation.tiny_llama()
    ids = torch.randint(3, 8192, (1, 4), generator=torch.Generator().manual_seed(0))
    want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                          min_new_tokens=6, pad_token_id=0)
    caches: list[object] = []
    real = type(model).generate

    def spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        caches.append(kwargs.get("cache_implementation"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "generate", spy)
    out: dict[str, float] = {}
    bench_generation._static_baseline(out, model, ids, 6, lambda: want, want, repeat=2)
    assert caches == ["static"] * 4  # the first (compiling) run, one warm-up, two timed
    assert out["gen_greedy_match_static"] == 1.0
    assert out["gen_latency_ratio_static"] > 0 and out["gen_unsplit_static_ms_per_token"] > 0
    assert out["gen_static_first_s"] > 0
    wrong = want.clone()
    wrong[0, -1] += 1
    bench_generation._static_baseline(out, model, ids, 6, lambda: want, wrong, repeat=1)
    assert out["gen_greedy_match_static"] == 0.0


@pytest.mark.slow  # test_bench_suites asserts these figures, from the same function at the same size
def test_bench_gen_batching() -> None:
    results = _json(_bench("bench.gen_batching", "--gen-sessions", "2", "--gen-new-tokens", "4", "--repeat", "1",
                           "--switch-interval", "0.0005", "--gen-window-ms", "5", "1",
                           "--client-decode-steps", "fixed", "--json"))
    assert results["gen_batched_greedy_match"] == 1.0 and results["gen_batched_sessions"] == 2.0
    assert results["gen_client_decode_steps"] == "fixed"
    # the second window ran against the same one-by-one runs
    assert results["gen_batched_tokens_per_s_window_1ms"] > 0 and results["gen_batched_speedup_window_1ms"] > 0
    assert results["gen_batched_mean_batch_window_1ms"] >= 0
    assert results["switch_interval_s"] == 0.0005  # the server process's, as asked
    assert results["gen_replay_batched_speedup"] > 0 and results["gen_replay_batched_mean_batch"] >= 1.0


@pytest.mark.slow
def test_bench_leakage() -> None:
    results = _json(_bench("bench.leakage", "--quick", "--only", "mnist", "--steps", "2", "--attack-steps", "2",
                           "--json"))
    settings = [row["setting"] for row in results["rows"]]
    assert len(settings) == 6 and settings[0] == "none"


def test_bench_tls(tmp_path: Path) -> None:
    _bench("bench.tls", "--reps", "1", "--json", str(tmp_path / "tls.json"))
    results = json.loads((tmp_path / "tls.json").read_text())
    assert results["issue-ms"] > 0 and [r["bytes"] for r in results["forward-ms"]] == [16 << 10, 1 << 20, 16 << 20]


# -- benchmarks made of flwr runs (one tiny run each) --------------------------------------------------------
@pytest.mark.slow
def test_bench_compression(tmp_path: Path) -> None:
    _bench("bench.compression", "--only", "none", "--supernodes", "2", "--extra",
           "num-server-rounds=1 local-steps=2 eval-batches=1", "--json", str(tmp_path / "c.json"))
    (run,) = json.loads((tmp_path / "c.json").read_text()).values()
    assert run["status"] == "completed" and run["mb_per_round"] > 0 and run["failed_client_calls"] == 0


@pytest.mark.slow  # its one flwr run is like test_bench_compression's, plus centralized training (80 s busy)
def test_bench_mnist_curves(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    _bench("bench.mnist_curves", "--only", "iid", "--rounds", "1", "--local-steps", "2", "--out", str(tmp_path))
    curves = json.loads((tmp_path / "mnist_curves.json").read_text())
    assert set(curves) == {"SplitFed, 4 IID clients", "centralized (unsplit, same steps)"}
    assert all(len(ys) == 1 for ys in curves.values()) and (tmp_path / "mnist_curves.png").exists()


@pytest.mark.slow
def test_bench_variants(tmp_path: Path) -> None:
    _bench("bench.variants", "--only", "sync", "--partitions", "4 IID clients", "--rounds", "1", "--extra",
           "local-steps=2 eval-batches=1", "--out", str(tmp_path))
    (row,) = json.loads((tmp_path / "variants.json").read_text())
    assert row["status"] == "completed" and len(row["curves"]["accuracy"]) == 1


@pytest.mark.slow  # over 9 minutes on a busy 2-core machine: the unsplit perplexity, then a LoRA flwr run
def test_bench_llm_finetune(tmp_path: Path) -> None:
    from llm_fixtures import save_tiny

    folder = save_tiny("llama", tmp_path / "model")
    out = tmp_path / "llm.json"
    _bench("bench.llm_finetune", "--model", str(folder), "--cuts", "1,3", "--rounds", "1", "--local-steps", "2",
           "--clients", "2", "--seq-len", "16", "--batch-size", "2", "--out", str(out), timeout=1800)
    result = json.loads(out.read_text())
    assert result["pretrained_perplexity"] > 0 and len(result["perplexity_per_round"]) == 1
    assert 0 < result["adapter_bytes_per_client_per_round"] < result["full_client_part_bytes"]
