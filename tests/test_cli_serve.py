"""`splitfed serve` serves a trunk standalone (plaintext only with --insecure) that clients train against."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import uuid

import pytest
import torch
from serverproc import end_on_sigterm

from splitfed.channel.client.trunk import TrunkClient
from splitfed.split import CutState


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_command_serves_the_trunk() -> None:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "splitfed.cli", "serve", "--model", "mnist-cnn", "--cuts", "3,6",
                             "--port", str(port), "--insecure", "--trunk-mode", "async"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = TrunkClient(f"127.0.0.1:{port}", insecure=True)
        client.wait_ready(60)
        info = client.info()
        assert (info.model, list(info.cuts), info.trunk_mode) == ("mnist-cnn", [3, 6], "async")
        act = uuid.uuid4().hex
        out, version = client.forward(CutState(torch.randn(2, 32, 14, 14)), activation_id=act, train=True)
        assert out.shape == (2, 64, 7, 7) and version == 0
        assert client.backward(act, torch.ones_like(out)).trunk_version == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)


def test_serve_refuses_plaintext_without_insecure() -> None:
    result = subprocess.run([sys.executable, "-m", "splitfed.cli", "serve", "--model", "mnist-cnn", "--port", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "--insecure" in result.stderr


def _free_ports(n: int) -> int:
    """A port P with P + 1 .. P + n - 1 free too (replica r listens on --port + 1 + r)."""
    for _ in range(50):
        port = _free_port()
        try:
            for k in range(1, n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + k))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no {n} consecutive free ports")


@pytest.mark.slow  # CI: replicas' global sync steps: test_replicas.py; the router over them: test_router_training.py
def test_serve_replicas_take_global_sync_steps() -> None:
    """`splitfed serve --replicas 2`: one address (the router's) in front of both replicas, which also listen on
    --port + 1 + r; the router puts two clients on different replicas, and a sync step waits for the clients of
    both."""
    import threading

    port = _free_ports(3)
    proc = subprocess.Popen([sys.executable, "-m", "splitfed.cli", "serve", "--model", "mnist-cnn", "--cuts", "3,6",
                             "--port", str(port), "--insecure", "--replicas", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outcome: list[object] = []
    try:
        for r in range(2):  # each replica's own port
            direct = TrunkClient(f"127.0.0.1:{port + 1 + r}", insecure=True)
            direct.wait_ready(120)
            assert direct.info().model == "mnist-cnn"
            direct.close()
        clients = [TrunkClient(f"127.0.0.1:{port}", insecure=True, client_id=f"c{r}") for r in range(2)]
        for client in clients:
            client.wait_ready(120)
        acts = [uuid.uuid4().hex for _ in clients]
        outs = [c.forward(CutState(torch.randn(2, 32, 14, 14)), activation_id=a, train=True)[0]
                for c, a in zip(clients, acts)]

        def first_backward() -> None:
            try:
                outcome.append(clients[0].backward(acts[0], outs[0]).trunk_version)
            except Exception as exc:  # noqa: BLE001 - asserted below
                outcome.append(exc)

        first = threading.Thread(target=first_backward)
        first.start()
        first.join(2)
        assert first.is_alive(), outcome  # replica 0's client waits for replica 1's
        second = clients[1].backward(acts[1], outs[1]).trunk_version
        first.join(30)
        assert outcome == [1] and second == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-3000:]
    assert f"on 127.0.0.1:{port} (replicas: 127.0.0.1:{port + 1}, 127.0.0.1:{port + 2})" in out, out[-3000:]


@pytest.mark.parametrize("model", [["--model", "mnist-cnn", "--cuts", "3,6"], ["--model", "cnn=mnist-cnn:3,6"]],
                         ids=["one-trunk", "models"])
def test_sigusr1_prints_every_threads_stack_and_sigterm_then_ends_the_server(model: list[str]) -> None:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "splitfed.cli", "serve", *model, "--port", str(port), "--insecure"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        client = TrunkClient(f"127.0.0.1:{port}", insecure=True, model=model[1].partition("=")[0])
        client.wait_ready(90)
        proc.send_signal(signal.SIGUSR1)  # a look at what it does: it goes on serving
        out, _ = client.forward(CutState(torch.randn(2, 32, 14, 14)), train=False)
        assert out.shape == (2, 64, 7, 7) and proc.poll() is None
        client.close()
    finally:
        err = end_on_sigterm(proc)
    # 0 once it serves until signalled; a SIGTERM in the moment before (the server answers while it starts) ends
    # it by the signal's default action.
    assert proc.returncode in (0, -signal.SIGTERM), err[-3000:]
    assert "Current thread" in err and 'File "' in err, err[-3000:]
