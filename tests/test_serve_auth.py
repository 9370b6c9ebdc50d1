"""Who may reach ``splitfed serve`` and ``splitfed route`` off loopback: plaintext there only with
``--allow-insecure-remote`` (and one WARNING), and every caller authenticated by the static token
(``--token-file`` / ``$SPLITFED_TOKEN``) or a client certificate (``--tls-client-ca``). Servers bind 0.0.0.0 but
tests connect through 127.0.0.1 only."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from pki import Pki, make_pki
from serverproc import end_on_sigterm

from splitfed.channel.security.tokens import StaticToken, load_token_file
from splitfed.channel.client.trunk import RetryPolicy, TrunkClient
from splitfed.channel.security.credentials import channel_credentials
from splitfed.errors import AuthError, ChannelError
from splitfed.split import CutState

FAIL_FAST = RetryPolicy(max_attempts=1, initial_backoff_s=0.05)
TOKEN = "right-token-0123456789abcdef"
CMD = [sys.executable, "-m", "splitfed.cli"]
SERVE = [*CMD, "serve", "--model", "mnist-cnn", "--cuts", "3,6", "--trunk-mode", "async"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(token: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SPLITFED_TOKEN"}
    if token is not None:
        env["SPLITFED_TOKEN"] = token
    return env


def _refused(args: list[str], env: dict[str, str] | None = None) -> str:
    """The one stderr line of a command that must refuse to start (exit status 1)."""
    result = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env or _env())
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, (result.returncode, result.stderr)
    return lines[0]


def _forward(client: TrunkClient) -> torch.Size:
    out, _ = client.forward(CutState(torch.randn(2, 32, 14, 14)), activation_id=uuid.uuid4().hex, train=False)
    return out.shape


def _code(client: TrunkClient) -> tuple[str, str]:
    with pytest.raises(ChannelError) as info:
        _forward(client)
    return info.value.code, str(info.value)


@pytest.mark.parametrize("command", [SERVE, [*CMD, "route", "--backend", "127.0.0.1:1"]], ids=["serve", "route"])
def test_plaintext_on_every_interface_is_refused_without_allow_insecure_remote(command: list[str]) -> None:
    line = _refused([*command, "--host", "0.0.0.0", "--port", "0", "--insecure"], _env(TOKEN))
    assert line.startswith(f"splitfed {command[3]}: error: --insecure would serve plaintext on 0.0.0.0")
    assert "--allow-insecure-remote" in line


@pytest.mark.parametrize("command", [SERVE, [*CMD, "route", "--backend", "127.0.0.1:1"]], ids=["serve", "route"])
def test_off_loopback_a_token_is_required(command: list[str]) -> None:
    line = _refused([*command, "--host", "0.0.0.0", "--port", "0", "--insecure", "--allow-insecure-remote"])
    assert "clients must authenticate" in line and "--token-file" in line and "--tls-client-ca" in line


def test_allowed_plaintext_warns_once_and_wrong_tokens_are_refused_while_it_serves() -> None:
    port = _free_port()
    proc = subprocess.Popen([*SERVE, "--host", "0.0.0.0", "--port", str(port), "--insecure",
                             "--allow-insecure-remote"], stderr=subprocess.PIPE, text=True, env=_env(TOKEN))
    try:
        address = f"127.0.0.1:{port}"
        TrunkClient(address, insecure=True, token=TOKEN).wait_ready(90)
        for token, why in ((None, "missing authorization"), ("wrong-token-0123456789abcdef", "wrong token")):
            code, message = _code(TrunkClient(address, insecure=True, token=token, retry=FAIL_FAST))
            assert code == "UNAUTHENTICATED" and why in message, (code, message)
        assert _forward(TrunkClient(address, insecure=True, token=TOKEN)) == (2, 64, 7, 7)  # same server
    finally:
        err = end_on_sigterm(proc)  # one that does not end fails the test with its threads' stacks
    warnings = [line for line in err.splitlines() if " WARNING " in line and "UNAUTHENTICATED" not in line]
    assert len(warnings) == 1 and "PLAINTEXT on 0.0.0.0" in warnings[0], err


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), nodes=1)


def test_tls_without_client_certificates_still_needs_a_token_off_loopback(pki: Pki) -> None:
    line = _refused([*SERVE, "--host", "0.0.0.0", "--port", "0", "--tls-cert", pki.cert("server"), "--tls-key",
                     pki.key("server")])
    assert "clients must authenticate" in line


def test_mutual_tls_stands_in_for_the_token(pki: Pki) -> None:
    port = _free_port()
    proc = subprocess.Popen([*SERVE, "--host", "0.0.0.0", "--port", str(port), "--tls-cert", pki.cert("server"),
                             "--tls-key", pki.key("server"), "--tls-client-ca", pki.cert("ca")],
                            stderr=subprocess.PIPE, text=True, env=_env())
    try:
        address = f"127.0.0.1:{port}"
        mine = channel_credentials(pki.cert("ca"), pki.cert("node-0"), pki.key("node-0"))
        TrunkClient(address, credentials=mine).wait_ready(90)
        assert _forward(TrunkClient(address, credentials=mine)) == (2, 64, 7, 7)
        for name in (None, "stranger"):
            pair = () if name is None else (pki.cert(name), pki.key(name))
            code, _ = _code(TrunkClient(address, credentials=channel_credentials(pki.cert("ca"), *pair),
                                        retry=FAIL_FAST))
            assert code == "UNAVAILABLE", name  # the handshake is refused
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert " WARNING " not in err, err


def test_a_missing_token_file_is_created_private_and_then_read(tmp_path: Path) -> None:
    path = tmp_path / "token"
    token = load_token_file(path, create=True)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(token) >= 32
    assert load_token_file(path, create=True) == token  # never overwritten
    path.write_text("short\n")
    with pytest.raises(AuthError, match="at least 16"):
        load_token_file(path)


def test_the_static_token_check() -> None:
    check = StaticToken(TOKEN)
    assert check.authenticate({"authorization": f"Bearer {TOKEN}", "x-splitfed-client": "a"}) == "token-a"
    for header in ("", "Basic abc", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}"):
        with pytest.raises(AuthError):
            check.authenticate({"authorization": header})


def test_the_router_checks_the_token_and_sends_the_backends_theirs(trunk_server) -> None:
    from conftest import tiny_model

    from splitfed.channel.routing import Router
    from splitfed.split import split_model

    backend_token = "backend-token-0123456789abcdef"
    server = trunk_server(split_model(tiny_model("llama").train(), cuts=(1, 3)).trunk,
                          authenticate=StaticToken(backend_token).authenticate)
    with Router([server.address], host="0.0.0.0", port=0, insecure=True, authenticate=StaticToken(TOKEN).authenticate,
                backend_token=backend_token).start() as router:
        address = f"127.0.0.1:{router.port}"
        hidden = CutState(torch.randn(2, 5, 32))
        for token in (None, backend_token):
            with pytest.raises(ChannelError) as info:
                TrunkClient(address, insecure=True, token=token, retry=FAIL_FAST).forward(hidden, train=False)
            assert info.value.code == "UNAUTHENTICATED", token
        out, _ = TrunkClient(address, insecure=True, token=TOKEN).forward(hidden, train=False)
        assert out.shape == (2, 5, 32)
