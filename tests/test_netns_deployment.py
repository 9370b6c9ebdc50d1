"""A deployment across two network namespaces joined by a veth pair: the SuperLink, the ServerApp and its trunk
in one, two SuperNodes in the other. The trunk binds to the server namespace's veth address (not loopback), with
no certificate files: the zero-configuration TLS is the only thing securing the split channel. From the client
namespace, a plaintext health check to the trunk is refused and one pinned to the issued CA is answered.

Needs root and ``ip netns`` (skipped with the reason otherwise). Slow: ``python -m pytest -q -m slow``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_e2e_flwr import BIN, ROOT, _env, _run_id, flwr_home  # noqa: F401  (a fixture)

from splitfed.channel.security.policy import CA_FILE
from splitfed.run.report import run_folder

TESTS = Path(__file__).resolve().parent
LINK_PORT, TRUNK_PORT = 9093, 50051  # fresh namespaces: every port is free

PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from test_e2e_tls import probe
print(json.dumps(probe(sys.argv[2], open(sys.argv[3], "rb").read())))
"""

WAIT_PORT = r"""
import socket, sys, time
deadline = time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:
    with socket.socket() as s:
        if s.connect_ex((sys.argv[1], int(sys.argv[2]))) == 0:
            sys.exit(0)
    time.sleep(0.3)
sys.exit(1)
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class Namespaces:
    """Two network namespaces, ``server`` and ``client``, joined by a veth pair on a private /24."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.server, self.client = f"sfs{tag}", f"sfc{tag}"
        subnet = 10 + os.getpid() % 240
        self.server_ip, self.client_ip = f"10.213.{subnet}.1", f"10.213.{subnet}.2"
        _ip("netns", "add", self.server)
        try:
            _ip("netns", "add", self.client)
            _ip("link", "add", f"vs{tag}", "type", "veth", "peer", "name", f"vc{tag}")
            for ns, dev, addr in ((self.server, f"vs{tag}", self.server_ip), (self.client, f"vc{tag}", self.client_ip)):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.delete()
            raise

    def cmd(self, ns: str, *argv: str) -> list[str]:
        """``argv`` run inside namespace ``ns``."""
        return ["ip", "netns", "exec", ns, *argv]

    def delete(self) -> None:
        for ns in (self.server, self.client):  # deleting a namespace deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)


@pytest.fixture
def namespaces() -> Iterator[Namespaces]:
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command (iproute2) is not installed")
    try:
        spaces = Namespaces()
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create network namespaces here (needs root and `ip netns`): {exc.stderr.strip()}")
    yield spaces
    spaces.delete()


@pytest.mark.slow
def test_deployment_across_namespaces_uses_zero_config_tls(namespaces: Namespaces, flwr_home: Path,
                                                            tmp_path: Path) -> None:
    env = _env(flwr_home)
    ns = namespaces
    out_dir = tmp_path / "outputs"
    logs = tmp_path / "logs"
    logs.mkdir()
    link = f"{ns.server_ip}:{LINK_PORT}"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(subprocess.Popen(ns.cmd(
            ns.server, str(BIN / "flower-superlink"), "--insecure", "--isolation", "subprocess",
            "--disable-runtime-dependency-installation", "--host", ns.server_ip, "--port", str(LINK_PORT),
            "--database", str(tmp_path / "state.db")),
            cwd=tmp_path, env=env, stdout=open(logs / "superlink.log", "wb"), stderr=subprocess.STDOUT))
        waited = subprocess.run(ns.cmd(ns.client, sys.executable, "-c", WAIT_PORT, ns.server_ip, str(LINK_PORT), "90"),
                                timeout=120, check=False)
        assert waited.returncode == 0, (logs / "superlink.log").read_text()[-3000:]
        for pid in range(2):
            procs.append(subprocess.Popen(ns.cmd(
                ns.client, str(BIN / "flower-supernode"), "--insecure", "--superlink", link,
                "--host", "127.0.0.1", "--port", str(9100 + pid), "--isolation", "subprocess",
                "--node-config", f"partition-id={pid} num-partitions=2"),
                cwd=tmp_path, env=env, stdout=open(logs / f"supernode{pid}.log", "wb"), stderr=subprocess.STDOUT))
        (flwr_home / "config.toml").write_text(
            f'[superlink]\ndefault = "deploy"\n\n[superlink.deploy]\naddress = "{link}"\ninsecure = true\n')
        # No tls-* keys and no trunk-advertise: the trunk binds to, and is dialled at, the veth address.
        overrides = (f"num-server-rounds=2 local-steps=10 trunk-bind='{ns.server_ip}' trunk-port={TRUNK_PORT} "
                     f"output-dir='{out_dir}'")
        run = subprocess.Popen(ns.cmd(ns.server, str(BIN / "flwr"), "run", ".", "deploy", "--stream",
                                      "--run-config", overrides),
                               cwd=ROOT, env=env, stdout=open(logs / "flwr-run.log", "wb"), stderr=subprocess.STDOUT)
        procs.append(run)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and run.poll() is None and not (run_folder(out_dir) / CA_FILE).exists():
            time.sleep(0.2)
        assert (run_folder(out_dir) / CA_FILE).exists(), (logs / "flwr-run.log").read_text()[-3000:]
        # From the SuperNodes' namespace, across the veth: the trunk speaks TLS only, with the issued CA only.
        probed = subprocess.run(ns.cmd(ns.client, sys.executable, "-c", PROBE, str(TESTS),
                                       f"{ns.server_ip}:{TRUNK_PORT}", str(run_folder(out_dir) / CA_FILE)),
                                cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
        assert probed.returncode == 0, probed.stderr[-3000:]
        assert json.loads(probed.stdout) == {"plaintext": "UNAVAILABLE", "another-ca": "UNAVAILABLE",
                                             "issued-ca": "SERVING"}
        run.wait(900)
        output = (logs / "flwr-run.log").read_text(errors="replace")
        status = subprocess.run(ns.cmd(ns.server, str(BIN / "flwr"), "list", "deploy", "--run-id", _run_id(output),
                                       "--format", "json"),
                                cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
        assert json.loads(status.stdout)["runs"][0]["status"] == "finished:completed", \
            f"{status.stdout[-1500:]}\n{status.stderr[-1500:]}\n{output[-3000:]}"
        history = json.loads((run_folder(out_dir) / "history.json").read_text())  # the run's own folder
        assert [r["round"] for r in history["rounds"]] == [1, 2]
        assert history["rounds"][-1]["train"]["train-steps"] == 20  # two supernodes, 10 steps each, over TLS
        assert history["rounds"][-1]["evaluate"]["num-examples"] == 1000
        assert history["config"]["trunk-bind"] == ns.server_ip and history["config"]["tls-cert"] == ""
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
