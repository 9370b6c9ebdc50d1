"""Prometheus metrics moved by the right amounts, a dashboard that queries only exported metrics,
JSON logs with context, plots and the report command."""

from __future__ import annotations

import json
import logging
import re
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from prometheus_client.parser import text_string_to_metric_families

from splitfed.channel.client.trunk import TrunkClient
from splitfed.split import CutState, split_model

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "docs" / "grafana" / "splitfed-dashboard.json"


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            # An empty label value is no label (Prometheus' own rule): an unnamed model's series carry model="".
            labels = {k: v for k, v in sample.labels.items() if v != ""}
            out[(sample.name, tuple(sorted(labels.items())))] = sample.value
    return out


def _value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _scrape_until(port: int, name: str, **labels) -> dict[tuple[str, tuple], float]:
    """Scrape until ``name{labels}`` is counted: an RPC is counted once its status has been sent."""
    import time

    deadline = time.monotonic() + 5
    while True:
        samples = _scrape(port)
        if _value(samples, name, **labels) or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def test_metrics_count_rpcs_bytes_and_steps_exactly(trunk_server) -> None:
    split = split_model(tiny_model("llama").train(), cuts=(1, 3))
    server = trunk_server(split.trunk, metrics_port=0)
    client = TrunkClient(server.address, insecure=True)
    steps, batch, length = 4, 2, 5
    hidden_bytes = batch * length * 32 * 4
    for _ in range(steps):
        act = uuid.uuid4().hex
        out, _ = client.forward(CutState(torch.randn(batch, length, 32)), activation_id=act, train=True)
        client.backward(act, torch.ones_like(out))
    with pytest.raises(Exception):
        client.backward("no-such-activation", torch.ones(batch, length, 32))
    s = _scrape(server.metrics_port)
    assert _value(s, "splitfed_rpc_total", method="Forward", code="OK") == steps
    assert _value(s, "splitfed_rpc_total", method="Backward", code="OK") == steps
    assert _value(s, "splitfed_rpc_total", method="Backward", code="NOT_FOUND") == 1
    assert _value(s, "splitfed_rpc_seconds_count", method="Forward") == steps
    # Received: hidden per forward and the gradient per backward (the refused one was decoded too).
    assert _value(s, "splitfed_wire_bytes_total", direction="received", dtype="float32") == \
        steps * 2 * hidden_bytes + hidden_bytes
    assert _value(s, "splitfed_wire_bytes_total", direction="sent", dtype="float32") == steps * 2 * hidden_bytes
    assert _value(s, "splitfed_trunk_steps_total") == steps == _value(s, "splitfed_trunk_version")
    assert _value(s, "splitfed_gradients_total", outcome="applied") == steps
    assert _value(s, "splitfed_gradient_staleness_count") == steps
    assert _value(s, "splitfed_step_gradients_sum") == steps
    assert _value(s, "splitfed_saved_forwards") == 0 and _value(s, "splitfed_saved_forward_bytes") == 0
    assert _value(s, "process_resident_memory_bytes") > 0
    # Inference sessions: KV-cache bytes appear while a session is open.
    session, _ = client.open_session(max_length=8)
    client.forward(CutState(torch.randn(1, 3, 32)), train=False, session_id=session)
    s = _scrape(server.metrics_port)
    assert _value(s, "splitfed_inference_sessions") == 1 and _value(s, "splitfed_kv_cache_bytes") > 0
    client.close_session(session)
    assert _value(_scrape(server.metrics_port), "splitfed_kv_cache_bytes") == 0


def test_dashboard_is_grafana_json_and_queries_only_exported_metrics(trunk_server) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["schemaVersion"] >= 30 and dashboard["panels"]
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert all(p["type"] == "timeseries" and p["gridPos"] and p["targets"] for p in dashboard["panels"])
    split = split_model(tiny_model("llama").train(), cuts=(1, 3))
    server = trunk_server(split.trunk, metrics_port=0)
    client = TrunkClient(server.address, insecure=True)
    act = uuid.uuid4().hex
    out, _ = client.forward(CutState(torch.randn(1, 3, 32)), activation_id=act, train=True)
    client.backward(act, torch.ones_like(out))
    exported = {name for name, _ in _scrape(server.metrics_port)}
    names = {m for e in exprs for m in re.findall(r"\b((?:splitfed|process)_[a-z_]+)", e)}
    assert names and names <= exported, sorted(names - exported)


def test_json_logs_carry_run_round_client_and_step(capsys) -> None:
    from splitfed.logs import setup_logging

    setup_logging("DEBUG", json_lines=True, run_id=42)
    logging.getLogger("splitfed.test").info("round done", extra={"round": 3, "client": "node-7", "step": 11})
    line = capsys.readouterr().err.strip().splitlines()[-1]
    record = json.loads(line)
    assert record["message"] == "round done" and record["level"] == "INFO"
    assert (record["run_id"], record["round"], record["client"], record["step"]) == (42, 3, "node-7", 11)
    setup_logging("WARNING")


def test_run_leaves_plots_and_history_and_report_redraws_them(tmp_path: Path, capsys) -> None:
    from flower_harness import run_apps

    from splitfed.cli.main import main

    _, out = run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=2, local_steps=3)
    for name in ("loss.png", "accuracy.png", "bytes.png", "seconds.png", "history.json"):
        assert (out / name).stat().st_size > 0, name
    redraw = tmp_path / "redraw"
    assert main(["report", str(out), "--plots-dir", str(redraw)]) == 0
    table = capsys.readouterr().out
    assert "train-loss" in table and len([ln for ln in table.splitlines() if ln.strip()[:1].isdigit()]) == 2
    for name in ("loss.png", "accuracy.png", "bytes.png", "seconds.png"):
        assert (redraw / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fault_metrics_count_exactly(trunk_server) -> None:
    """Evictions, dropped members, retried requests, recomputed forwards, rejections, step waits, epsilon."""
    import time

    from splitfed.channel.server.trunkserver import CLIENT_ID_KEY
    from splitfed.trunk.aggregation.modes import make_aggregator
    from splitfed.trunk.compute.store import StoreLimits

    split = split_model(tiny_model("llama").train(), cuts=(1, 3))
    agg = make_aggregator("quorum", quorum=2, max_staleness=0, timeout=0.5)
    server = trunk_server(split.trunk, metrics_port=0, aggregator=agg, store_limits=StoreLimits(ttl_s=2.0))
    hidden = torch.randn(1, 3, 32)
    a, b = (TrunkClient(server.address, insecure=True, client_id=c) for c in ("a", "b"))
    # 1. "b" forwards and goes silent: "a"'s step waits for it, then drops it; its forward is evicted later.
    b.forward(CutState(hidden), activation_id="b-lost", train=True)
    act = uuid.uuid4().hex
    out, _ = a.forward(CutState(hidden), activation_id=act, train=True)
    assert a.backward(act, torch.ones_like(out)).outcome == "APPLIED"
    # 2. "b" forwards on version 1 (and so rejoins) and goes silent again: "a"'s step waits for it, drops it
    #    again and steps; b's late gradient is 1 stale with max-staleness 0, so it is rejected, and its
    #    forward, rebased by the step, is recomputed for the input gradient.
    b.forward(CutState(hidden), activation_id="b-stale", train=True)
    act = uuid.uuid4().hex
    out, _ = a.forward(CutState(hidden), activation_id=act, train=True)
    assert a.backward(act, torch.ones_like(out)).outcome == "APPLIED"
    assert b.backward("b-stale", torch.ones_like(out)).outcome == "REJECTED_STALE"
    # 3. A request that arrives marked as a gRPC retry.
    from splitfed.channel.wire import split_channel_pb2 as pb
    from splitfed.channel.wire.messages import to_proto
    from splitfed.codec.tensors import encode

    req = pb.ForwardRequest(activation_id=uuid.uuid4().hex, train=False,
                            tensors=[to_proto(encode("hidden", hidden, None))])
    import grpc

    with grpc.insecure_channel(server.address) as channel:
        channel.unary_unary("/splitfed.v1.SplitChannel/Forward", request_serializer=pb.ForwardRequest.SerializeToString,
                            response_deserializer=lambda raw: raw)(
            req, metadata=[(CLIENT_ID_KEY, "a"), ("x-splitfed-retry", "1")], timeout=10)
    server.metrics.set_epsilon(2.5)
    deadline = time.monotonic() + 10
    while server.runtime.store.evicted < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    s = _scrape_until(server.metrics_port, "splitfed_retried_requests_total", method="Forward")
    assert _value(s, "splitfed_dropped_members_total") == 2
    assert _value(s, "splitfed_evictions_total") == 1  # "b-lost", after its TTL
    assert _value(s, "splitfed_retried_requests_total", method="Forward") == 1
    assert _value(s, "splitfed_recomputed_forwards_total") == 1
    assert _value(s, "splitfed_gradients_total", outcome="rejected-stale") == 1
    assert _value(s, "splitfed_gradients_total", outcome="applied") == 2
    assert _value(s, "splitfed_step_wait_seconds_count") == 2  # the rejected one never waited for a step
    assert 0.8 <= _value(s, "splitfed_step_wait_seconds_sum") < 10  # both steps waited for the silent member
    assert _value(s, "splitfed_dp_epsilon") == 2.5
