"""`splitfed route --proxy nginx` with the real nginx: split steps and a generation session through it, calls by
model, the clients' token, TLS towards clients and servers, failover to the other server, retries marked, `--check`."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import batch_for, tiny_cnn, tiny_model

from splitfed.channel.security.autotls import issue
from splitfed.channel.client.trunk import TrunkClient
from splitfed.channel.routing.discovery import discover
from splitfed.channel.routing.nginx import NginxProxy, NginxSettings
from splitfed.channel.security.credentials import pinned_channel_credentials, server_credentials
from splitfed.channel.server.trunkserver import TrunkServer
from splitfed.errors import ChannelError
from splitfed.client.generation import generate
from splitfed.split import CutState, split_model
from splitfed.trunk.aggregation.modes import make_aggregator

pytestmark = pytest.mark.skipif(
    shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists(),
    reason="nginx is not installed (Debian: apt-get install nginx; .ci/run installs it)")

TOKEN = "a-token-of-thirty-two-characters"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _step(client: TrunkClient) -> str:
    act = uuid.uuid4().hex
    out, _ = client.forward(CutState(torch.randn(2, 4, 14, 14)), activation_id=act, train=True)
    return client.backward(act, torch.ones_like(out)).outcome


@pytest.fixture
def servers() -> Iterator[list[TrunkServer]]:
    """Two tiny Llama trunk servers (model "llama") and one CNN trunk server (model "cnn")."""
    started = [TrunkServer(split_model(tiny_model("llama"), (1, 3)).trunk, insecure=True, model_name="llama").start()
               for _ in range(2)]
    started.append(TrunkServer(split_model(tiny_cnn(), (3, 6)).trunk, insecure=True, model_name="cnn",
                               aggregator=make_aggregator("async")).start())
    yield started
    for s in started:
        s.stop(grace=0)


def test_route_command_runs_nginx_for_split_steps_and_a_generation_session(servers: list[TrunkServer]) -> None:
    # Prepare: the docs' command, nginx in front of all three servers
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "splitfed.cli", "route", "--proxy", "nginx", "--insecure",
                             "--port", str(port), *[f"--backend={s.address}" for s in servers]],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    address = f"127.0.0.1:{port}"
    try:
        TrunkClient(address, insecure=True, model="cnn").wait_ready(120)
        # Execute: training steps of the CNN (each backward must reach the server that holds its forward)
        trainers = [TrunkClient(address, insecure=True, client_id=f"t{i}", model="cnn") for i in range(2)]
        outcomes = [_step(c) for _ in range(2) for c in trainers]
        # ...and greedy generation with the Llama (an inference session: open, one step per token, close)
        model = tiny_model("llama").eval()
        parts = split_model(tiny_model("llama").eval(), (1, 3))
        ids, mask, _ = batch_for("llama", batch=1, length=6)
        want = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8, pad_token_id=0,
                              eos_token_id=None)
        with TrunkClient(address, insecure=True, client_id="gen", model="llama") as client:
            got = generate(parts.bottom, client, parts.top, ids, mask, max_new_tokens=8)
        # Assert: every step applied on the CNN server; generation token for token the unsplit model's, all its
        # steps on one of the two Llama servers
        assert outcomes == ["APPLIED"] * 4 and servers[2].runtime.version == 4
        assert torch.equal(got, want)
        steps = sorted(s.servicer.sessions.stats["steps"] for s in servers[:2])
        assert steps == [0, 8], steps
        for c in trainers:
            c.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-3000:]
    assert f"listening on {address}" in out and "llama: " in out, out[-3000:]


def test_calls_go_by_model_and_client_and_move_when_a_server_dies(tmp_path: Path) -> None:
    # Prepare: m1 on two servers, m2 on one; nginx in front of them, checking the clients' token
    servers = [TrunkServer(split_model(tiny_cnn(), (3, 6)).trunk, insecure=True, model_name=name,
                           aggregator=make_aggregator("async")).start() for name in ("m1", "m1", "m2")]
    found = discover([s.address for s in servers])
    assert found.models == {"m1": (servers[0].address, servers[1].address), "m2": (servers[2].address,)}
    proxy = NginxProxy(NginxSettings(port=_free_port(), token=TOKEN), found, tmp_path).start()
    try:
        def client(name: str, model: str, token: str = TOKEN) -> TrunkClient:
            return TrunkClient(proxy.address, insecure=True, client_id=name, model=model, token=token)

        # Execute: eight clients of m1 take a step each, twice; one of m2
        m1 = [client(f"c{i}", "m1") for i in range(8)]
        assert all(_step(c) == "APPLIED" for _ in range(2) for c in m1)
        assert _step(client("d", "m2")) == "APPLIED"
        # Assert: each m1 client stayed on one server (its backwards found their forwards), both servers took some
        assert servers[2].runtime.version == 1 and servers[0].runtime.version + servers[1].runtime.version == 16
        assert servers[0].runtime.version > 0 and servers[1].runtime.version > 0
        # a model no server serves, and a wrong token: nginx's own gRPC answers
        with pytest.raises(ChannelError) as err:
            client("lost", "m3").info()
        assert err.value.code == "NOT_FOUND" and "m1, m2" in str(err.value)
        with pytest.raises(ChannelError) as err:
            client("thief", "m1", token="not-the-token-of-thirty-two-chars").info()
        assert err.value.code == "UNAUTHENTICATED"
        # a server dies: its clients' next calls go to the other server of m1
        servers[0].stop(grace=0)
        assert all(c.info().model == "m1" for c in m1)
        before = servers[1].runtime.version
        assert all(_step(c) == "APPLIED" for c in m1) and servers[1].runtime.version == before + 8
        # asked again, the servers' models have changed: nginx reloads without the dead server in m1's group
        assert proxy.update(discover([s.address for s in servers]))
        assert proxy.found.models["m1"] == (servers[1].address,) and all(_step(c) == "APPLIED" for c in m1)
        for c in m1:
            c.close()
    finally:
        proxy.stop()
        for s in servers:
            s.stop(grace=0)


def test_tls_towards_clients_and_servers(tmp_path: Path) -> None:
    # Prepare: one certificate (and its CA) for nginx and the trunk server, the trunk server over TLS
    issued = issue(["127.0.0.1", "localhost"])
    chain, key, ca = tmp_path / "chain.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    chain.write_bytes(issued.cert_pem + issued.ca_pem)
    key.write_bytes(issued.server_key_pem)
    ca.write_bytes(issued.ca_pem)
    server = TrunkServer(split_model(tiny_cnn(), (3, 6)).trunk, credentials=server_credentials(chain, key),
                         model_name="cnn").start()
    from splitfed.channel.security.credentials import channel_credentials

    found = discover([server.address], credentials=channel_credentials(ca))
    settings = NginxSettings(port=_free_port(), tls_cert=str(chain), tls_key=str(key), backend_ca=str(ca),
                             backend_tls_name="localhost")
    proxy = NginxProxy(settings, found, tmp_path / "nginx").start()
    try:
        # Execute: a training step over TLS to nginx, which reaches the server over TLS
        client = TrunkClient(proxy.address, credentials=pinned_channel_credentials(issued.ca_pem), model="cnn")
        # Assert
        assert _step(client) == "APPLIED" and server.runtime.version == 1
        client.close()
    finally:
        proxy.stop()
        server.stop(grace=0)


def test_check_prints_a_configuration_nginx_accepts(tmp_path: Path, servers: list[TrunkServer],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from splitfed.cli.main import main

    assert main(["route", "--proxy", "nginx", "--check", "--insecure", "--proxy-dir", str(tmp_path),
                 "--port", str(_free_port()), *[f"--backend={s.address}" for s in servers]]) == 0
    out = capsys.readouterr().out
    assert "nginx -t accepts it" in out and "hash $splitfed_route_key consistent" in out
    assert '"llama" splitfed_model_' in out and (tmp_path / "nginx.conf").exists()
    assert main(["route", "--proxy", "nginx", "--check", "--insecure", "--backend-token-file", str(tmp_path / "t"),
                 f"--backend={servers[0].address}"]) != 0
    assert "the Python router only" in capsys.readouterr().err


def test_a_retried_call_reaches_the_server_marked_as_a_retry(tmp_path: Path) -> None:
    from test_router import _Recorder

    from splitfed.channel.wire.limits import CLIENT_ID_KEY

    # Prepare: the server answers the first attempt UNAVAILABLE; the client's gRPC retries it (its retry policy)
    backend = _Recorder().start()
    proxy = NginxProxy(NginxSettings(port=_free_port()), discover([backend.address]), tmp_path).start()
    try:
        client = TrunkClient(proxy.address, insecure=True, client_id="c1")
        backend.fail_next = True
        # Execute
        assert client.info().model == "rec"
        # Assert: gRPC's own attempt count passed through nginx as it is (the servicer reads it), the first attempt
        # without it
        attempts = [seen["metadata"] for seen in backend.seen if seen["metadata"].get(CLIENT_ID_KEY) == "c1"]
        assert [a.get("grpc-previous-rpc-attempts") for a in attempts] == [None, "1"]
        client.close()
    finally:
        proxy.stop()
        backend.stop()
