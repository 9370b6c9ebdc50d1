"""A busy port is refused at start, naming it: two trunk servers never share a port by accident (gRPC turns
SO_REUSEPORT on by default), unless several processes of one server ask to share it."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

from splitfed.channel.client.trunk import TrunkClient
from splitfed.channel.server.trunkserver import TrunkServer
from splitfed.errors import ConfigError
from splitfed.models.catalog import mnist_cnn
from splitfed.split import split_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trunk() -> torch.nn.Module:
    return split_model(mnist_cnn(), (3, 6)).trunk


def test_a_second_trunk_server_on_a_busy_port_is_refused_naming_the_port() -> None:
    port = _free_port()
    first = TrunkServer(_trunk(), port=port, insecure=True, model_name="first").start()
    try:
        with pytest.raises(ConfigError, match=f"port {port} is in use"):
            TrunkServer(_trunk(), port=port, insecure=True, model_name="second").start()
        # The first server still answers every call (none went to a second listener).
        with TrunkClient(first.address, insecure=True) as client:
            assert {client.info().model for _ in range(6)} == {"first"}
    finally:
        first.stop(grace=0)


def test_a_second_server_with_front_ends_on_a_port_front_ends_hold_is_refused() -> None:
    """Front-end processes bind with SO_REUSEPORT among themselves: a second server's would share the first's port
    silently, were the port not probed first."""
    port = _free_port()
    first = TrunkServer(_trunk(), port=port, insecure=True, model_name="first", frontends=1).start()
    try:
        with pytest.raises(ConfigError, match=f"port {port} is in use"):
            second = TrunkServer(_trunk(), port=port, insecure=True, model_name="second", frontends=1).start()
            second.stop(grace=0)
        with TrunkClient(first.address, insecure=True) as client:
            assert {client.info().model for _ in range(6)} == {"first"}
    finally:
        first.stop(grace=0)


def test_processes_of_one_server_share_a_port_only_when_they_ask() -> None:
    port = _free_port()
    servers = [TrunkServer(_trunk(), port=port, insecure=True, reuse_port=True).start() for _ in range(2)]
    try:
        assert [s.port for s in servers] == [port, port]
    finally:
        for server in servers:
            server.stop(grace=0)


def test_splitfed_serve_on_a_busy_port_fails_with_one_line() -> None:
    """``splitfed serve`` on the port of a running trunk server (here in this process) exits non-zero and says
    why, in one line; the running server still serves."""
    port = _free_port()
    first = TrunkServer(_trunk(), port=port, insecure=True, model_name="first").start()
    try:
        second = subprocess.run([sys.executable, "-m", "splitfed.cli", "serve", "--model", "mnist-cnn", "--port",
                                 str(port), "--insecure"], capture_output=True, text=True, timeout=120)
        assert second.returncode != 0
        errors = [line for line in second.stderr.splitlines() if line.startswith("splitfed serve: error:")]
        assert len(errors) == 1 and f"port {port} is in use" in errors[0], second.stderr
        assert "Traceback" not in second.stderr
        with TrunkClient(first.address, insecure=True) as client:
            assert client.info().model == "first"
    finally:
        first.stop(grace=0)


@pytest.mark.slow  # CI: test_splitfed_serve_on_a_busy_port_fails_with_one_line (the first server in-process)
def test_splitfed_serve_twice_on_one_port_fails_the_second_with_one_line() -> None:
    """The user's path: a second ``splitfed serve`` on the port of a running one exits non-zero and says why."""
    port = _free_port()
    cmd = [sys.executable, "-m", "splitfed.cli", "serve", "--model", "mnist-cnn", "--port", str(port), "--insecure"]
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with TrunkClient(f"127.0.0.1:{port}", insecure=True) as client:
            client.wait_ready(120)
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert second.returncode != 0 and first.poll() is None
        errors = [line for line in second.stderr.splitlines() if line.startswith("splitfed serve: error:")]
        assert len(errors) == 1 and f"port {port} is in use" in errors[0], second.stderr
        assert "Traceback" not in second.stderr
    finally:
        first.terminate()
        first.wait(30)
