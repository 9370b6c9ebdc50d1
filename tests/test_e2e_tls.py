"""The split channel off loopback through ``flwr run``: zero-configuration TLS with no certificate files, and
plaintext refused at start unless asked for explicitly. While the run trains, a gRPC health check to the trunk's
port is refused in plaintext and with another CA, and answered over TLS with the CA the ServerApp issued (written
to the output folder as public material). Mutual TLS with the operator's certificates (made with ``openssl``):
a run whose nodes present theirs completes, one whose nodes have none ends failed naming the keys to set, and
(slow) a deployment whose SuperNodes each name their own certificate in ``--node-config`` completes."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from flower_harness import run_folder
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pki import Pki, make_pki
from test_e2e_flwr import (  # noqa: F401  (flwr_home is a fixture)
    BIN,
    RAY_START_FLAKES,
    ROOT,
    _env,
    _free_port,
    _run_id,
    _status,
    flwr_home,
    flwr_run,
)

from splitfed.channel.security.autotls import issue
from splitfed.channel.security.policy import CA_FILE


def health(address: str, ca_pem: bytes | None, timeout: float = 10.0) -> int:
    """Health status of the trunk at ``address``: over TLS pinned to ``ca_pem``, or in plaintext when None."""
    channel = grpc.insecure_channel(address) if ca_pem is None else \
        grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca_pem))
    with channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status


def probe(address: str, ca_pem: bytes) -> dict[str, str]:
    """What the trunk answers in plaintext, with another CA, and with its own CA (status names)."""
    out = {}
    for name, root in (("plaintext", None), ("another-ca", issue(["127.0.0.1"]).ca_pem), ("issued-ca", ca_pem)):
        try:
            out[name] = health_pb2.HealthCheckResponse.ServingStatus.Name(health(address, root))
        except grpc.RpcError as exc:
            out[name] = exc.code().name
    return out


def _start_run(overrides: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([str(BIN / "flwr"), "run", ".", "local", "--stream", "--run-config", overrides,
                             "--federation-config", "num-supernodes=2 client-resources-num-cpus=1"],
                            cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)


def test_flwr_run_off_loopback_serves_zero_config_tls_only(flwr_home: Path, tmp_path: Path) -> None:
    """The suite's one real ``flwr run . local`` that completes (the main job's apps, one short round): its trunk
    is async, so the same run shows the async trunk stepping once per gradient through Flower's own tooling (the
    sync main job to 90% and ``tests/test_e2e_modes.py``'s own async run are slow tests)."""
    env = _env(flwr_home)
    port = _free_port()
    out_dir = tmp_path / "outputs"
    overrides = (f"trunk-bind='0.0.0.0' trunk-port={port} trunk-mode='async' num-server-rounds=1 local-steps=6 "
                 f"eval-batches=4 output-dir='{out_dir}'")
    for attempt in range(2):
        log = tmp_path / f"flwr-run-{attempt}.log"
        proc = _start_run(overrides, env, log)
        answers: dict[str, str] = {}
        try:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and proc.poll() is None and not (run_folder(out_dir) / CA_FILE).exists():
                time.sleep(0.2)
            if (run_folder(out_dir) / CA_FILE).exists() and proc.poll() is None:  # the trunk is serving: probe it
                answers = probe(f"127.0.0.1:{port}", (run_folder(out_dir) / CA_FILE).read_bytes())
            proc.wait(600)
        finally:
            if proc.poll() is None:
                proc.kill()
        output = log.read_text(errors="replace")
        if not any(flake in output for flake in RAY_START_FLAKES):
            break
        (run_folder(out_dir) / CA_FILE).unlink(missing_ok=True)
    assert answers == {"plaintext": "UNAVAILABLE", "another-ca": "UNAVAILABLE", "issued-ca": "SERVING"}, output[-3000:]
    assert _status("local", _run_id(output), env) == "finished:completed", output[-3000:]
    history = json.loads((run_folder(out_dir) / "history.json").read_text())
    assert [r["round"] for r in history["rounds"]] == [1]
    assert history["rounds"][0]["train"]["train-steps"] == 2 * 6  # both clients trained through the TLS trunk
    assert history["config"]["trunk-insecure"] is False and history["config"]["tls-cert"] == ""
    # the async trunk: one step per gradient, every gradient applied, down-weighted or rejected as stale
    last = history["rounds"][-1]
    assert last["failures"]["train"] == 0
    trunk = last["trunk"]
    assert trunk["trunk-steps"] == trunk["trunk-applied"] + trunk["trunk-downweighted"] > 0
    assert trunk["trunk-applied"] + trunk["trunk-rejected-stale"] + trunk["trunk-downweighted"] == 2 * 6


@pytest.mark.slow
def test_flwr_run_with_plaintext_off_loopback_fails_at_start(flwr_home: Path, tmp_path: Path) -> None:
    env = _env(flwr_home)
    out_dir = tmp_path / "outputs"
    log = tmp_path / "flwr-run.log"
    proc = _start_run(f"trunk-bind='0.0.0.0' trunk-insecure=true output-dir='{out_dir}'", env, log)
    proc.wait(600)
    output = log.read_text(errors="replace")
    assert _status("local", _run_id(output), env) == "finished:failed", output[-3000:]
    assert "trunk-allow-plaintext-remote = true" in output and "trunk-insecure = false" in output, output[-3000:]
    assert not (run_folder(out_dir) / "history.json").exists() and not (run_folder(out_dir) / CA_FILE).exists()


# -- mutual TLS with the operator's certificates -----------------------------------------------------------------
def _mtls_overrides(pki: Pki, out_dir: Path, *, client_certificates: bool) -> str:
    """The trunk on loopback with our certificate, requiring client certificates from our CA; with
    ``client_certificates``, every node presents node-0's (the run config's default)."""
    overrides = (f"tls-cert='{pki.cert('server')}' tls-key='{pki.key('server')}' tls-root-ca='{pki.cert('ca')}' "
                 f"tls-client-ca='{pki.cert('ca')}' num-server-rounds=1 local-steps=4 eval-batches=2 "
                 f"output-dir='{out_dir}'")
    if client_certificates:
        overrides += f" tls-client-cert='{pki.cert('node-0')}' tls-client-key='{pki.key('node-0')}'"
    return overrides


def _run_record(run_id: str, env: dict[str, str]) -> dict:
    out = subprocess.run([str(BIN / "flwr"), "list", "local", "--run-id", run_id, "--format", "json"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout)["runs"][0]


@pytest.mark.slow
def test_flwr_run_over_mutual_tls_completes(flwr_home: Path, tmp_path: Path) -> None:
    env = _env(flwr_home)
    pki = make_pki(tmp_path / "pki")
    out_dir = tmp_path / "outputs"
    output = flwr_run([".", "local", "--stream", "--run-config",
                       _mtls_overrides(pki, out_dir, client_certificates=True), "--federation-config",
                       "num-supernodes=2 client-resources-num-cpus=1"], env)
    assert _status("local", _run_id(output), env) == "finished:completed", output[-3000:]
    (round1,) = json.loads((run_folder(out_dir) / "history.json").read_text())["rounds"]
    assert round1["failures"]["train"] == 0 and round1["train"]["train-steps"] == 2 * 4
    assert not (run_folder(out_dir) / CA_FILE).exists()  # the operator's certificate: no issued CA


@pytest.mark.slow  # CI: tests/test_mutual_tls.py checks the same refusal and its message
def test_flwr_run_over_mutual_tls_without_client_certificates_fails_naming_the_keys(flwr_home: Path,
                                                                                    tmp_path: Path) -> None:
    env = _env(flwr_home)
    pki = make_pki(tmp_path / "pki")
    out_dir = tmp_path / "outputs"
    output = flwr_run([".", "local", "--stream", "--run-config",
                       _mtls_overrides(pki, out_dir, client_certificates=False), "--federation-config",
                       "num-supernodes=2 client-resources-num-cpus=1"], env)
    run = _run_record(_run_id(output), env)
    assert run["status"] == "finished:failed", output[-3000:]
    assert "tls-client-cert and tls-client-key" in run["status-details"], run["status-details"]
    history = json.loads((run_folder(out_dir) / "history.json").read_text())
    assert history["status"] == "failed" and not (run_folder(out_dir) / "model").exists()


@pytest.mark.slow
def test_deployment_whose_supernodes_name_their_own_certificates(flwr_home: Path, tmp_path: Path) -> None:
    """flower-superlink and two flower-supernodes on loopback; each SuperNode's --node-config names its own
    certificate and key (the run config names none)."""
    import signal

    from test_e2e_flwr import _wait_port

    env = _env(flwr_home)
    pki = make_pki(tmp_path / "pki")
    link, trunk_port = _free_port(), _free_port()
    out_dir = tmp_path / "outputs"
    logs = tmp_path / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(subprocess.Popen(
            [str(BIN / "flower-superlink"), "--insecure", "--isolation", "subprocess",
             "--disable-runtime-dependency-installation", "--host", "127.0.0.1", "--port", str(link),
             "--database", str(tmp_path / "state.db")],
            cwd=tmp_path, env=env, stdout=open(logs / "superlink.log", "wb"), stderr=subprocess.STDOUT))
        _wait_port(link)
        for pid in range(2):
            node = (f"partition-id={pid} num-partitions=2 tls-client-cert='{pki.cert(f'node-{pid}')}' "
                    f"tls-client-key='{pki.key(f'node-{pid}')}'")
            procs.append(subprocess.Popen(
                [str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{link}",
                 "--host", "127.0.0.1", "--port", str(_free_port()), "--isolation", "subprocess",
                 "--node-config", node],
                cwd=tmp_path, env=env, stdout=open(logs / f"supernode{pid}.log", "wb"), stderr=subprocess.STDOUT))
        (flwr_home / "config.toml").write_text(
            f'[superlink]\ndefault = "deploy"\n\n[superlink.deploy]\naddress = "127.0.0.1:{link}"\n'
            "insecure = true\n")
        overrides = _mtls_overrides(pki, out_dir, client_certificates=False) + (
            f" trunk-port={trunk_port} trunk-advertise='127.0.0.1:{trunk_port}'")
        result = subprocess.run([str(BIN / "flwr"), "run", ".", "deploy", "--stream", "--run-config", overrides],
                                cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        output = result.stdout + result.stderr
        assert _status("deploy", _run_id(output), env) == "finished:completed", output[-3000:]
        (round1,) = json.loads((run_folder(out_dir) / "history.json").read_text())["rounds"]
        assert round1["failures"]["train"] == 0 and round1["train"]["train-steps"] == 2 * 4
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
