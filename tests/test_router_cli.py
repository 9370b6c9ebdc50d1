"""`splitfed route` (the docs' command), its refusals, the router over TLS, and `python -m bench.router`."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import tiny_cnn

from splitfed.channel.security.autotls import issue
from splitfed.channel.client.trunk import TrunkClient
from splitfed.channel.routing import Router
from splitfed.channel.routing.tls import backend_tls
from splitfed.channel.security.credentials import pinned_channel_credentials, server_credentials
from splitfed.channel.server.trunkserver import TrunkServer
from splitfed.split import CutState, split_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def two_servers() -> Iterator[list[TrunkServer]]:
    servers = [TrunkServer(split_model(tiny_cnn(), (3, 6)).trunk, insecure=True, model_name="cnn").start()
               for _ in range(2)]
    yield servers
    for s in servers:
        s.stop(grace=0)


def test_route_command_puts_clients_on_both_backends(two_servers: list[TrunkServer]) -> None:
    # Prepare: the docs' command, in front of two trunk servers
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "splitfed.cli", "route", "--backend", two_servers[0].address,
                             "--backend", two_servers[1].address, "--port", str(port), "--insecure"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        clients = [TrunkClient(f"127.0.0.1:{port}", insecure=True, client_id=f"c{i}") for i in range(2)]
        clients[0].wait_ready(120)
        # Execute: each client takes two training steps through the router
        for _ in range(2):
            for c in clients:
                act = uuid.uuid4().hex
                out, _ = c.forward(CutState(torch.randn(2, 4, 14, 14)), activation_id=act, train=True)
                assert c.backward(act, torch.ones_like(out)).outcome == "APPLIED"
        # Assert: one client on each backend, each took its client's two steps
        assert [s.runtime.version for s in two_servers] == [2, 2]
        for c in clients:
            c.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-3000:]
    assert f"router listening on 127.0.0.1:{port}" in out, out[-3000:]


def test_route_refuses_plaintext_to_remote_backends_and_a_bad_backend(capsys: pytest.CaptureFixture[str]) -> None:
    from splitfed.cli.main import main

    assert main(["route", "--backend", "10.1.2.3:50052", "--port", "0", "--insecure"]) == 1
    assert "10.1.2.3:50052 are not on loopback: give --backend-ca" in capsys.readouterr().err
    assert main(["route", "--backend", "127.0.0.1:1", "--port", "0"]) == 1
    assert "or --insecure" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["route", "--backend", "nohostport", "--port", "0", "--insecure"])
    assert exit_.value.code == 2 and "--backend must be HOST:PORT" in capsys.readouterr().err


def test_router_over_tls_to_backends_over_tls(tmp_path: Path) -> None:
    # Prepare: one certificate (and its CA) for the trunk server and the router, as `serve --replicas` uses it
    issued = issue(["127.0.0.1"])
    chain, key = tmp_path / "chain.pem", tmp_path / "key.pem"
    chain.write_bytes(issued.cert_pem + issued.ca_pem)
    key.write_bytes(issued.server_key_pem)
    server = TrunkServer(split_model(tiny_cnn(), (3, 6)).trunk, credentials=server_credentials(chain, key),
                         model_name="cnn").start()
    credentials, options = backend_tls(chain)
    router = Router([server.address], credentials=server_credentials(chain, key), backend_credentials=credentials,
                    backend_options=options).start()
    try:
        client = TrunkClient(router.address, credentials=pinned_channel_credentials(issued.ca_pem))
        # Execute
        act = uuid.uuid4().hex
        out, _ = client.forward(CutState(torch.randn(2, 4, 14, 14)), activation_id=act, train=True)
        outcome = client.backward(act, torch.ones_like(out)).outcome
        # Assert
        assert outcome == "APPLIED" and router.stats()[0]["live"]
        client.close()
        # a router that does not trust the backend's certificate sees it down
        other = issue(["127.0.0.1"])
        wrong = tmp_path / "other.pem"
        wrong.write_bytes(other.cert_pem + other.ca_pem)
        untrusting = Router([server.address], insecure=True, backend_credentials=backend_tls(wrong)[0],
                            backend_options=options).start()
        assert not untrusting.stats()[0]["live"]
        untrusting.stop(grace=0)
    finally:
        router.stop(grace=0)
        server.stop(grace=0)


def test_router_bench_prints_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.router import main

    out = tmp_path / "router.json"
    assert main(["--reps", "3", "--seconds", "0.3", "--clients", "2", "--json", str(out)]) == 0
    assert "router / direct" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert [row["bytes"] for row in data["latency"]] == [4096, 1 << 20]
    assert all(row["ratio"] > 0 for row in data["latency"] + data["throughput"])
