"""Two network namespaces joined by a ``tc``-shaped veth pair, for :mod:`bench.wan`.

:func:`link` creates them (root, ``ip netns`` and ``tc`` with ``tbf`` needed: :class:`CannotRun` otherwise),
shapes both ends, starts processes inside them and removes all of it on every way out; namespaces left by a
killed run (``sfwan<pid>s``/``c``) are removed by the next run.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psutil

PREFIX = "sfwan"
SERVER_IP, CLIENT_IP = "10.77.0.1", "10.77.0.2"
UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


class CannotRun(Exception):
    """This machine cannot run the benchmark (exit code :data:`SKIP_EXIT`)."""


def parse_rate(text: str) -> float | None:
    """Bits per second of ``100mbit``, ``1gbit``, ``500kbit``; ``None`` for ``unshaped``."""
    if text == "unshaped":
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", text)
    if match is None:
        raise ValueError(f"a rate is like 100mbit, 1gbit, 500kbit or unshaped, not {text!r}")
    return float(match.group(1)) * UNITS[match.group(2)]


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=60, check=False)


def _check(*argv: str) -> None:
    done = _run(*argv)
    if done.returncode != 0:
        raise CannotRun(f"`{' '.join(argv)}` failed: {(done.stderr or done.stdout).strip()}")


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces this benchmark left behind in runs that were killed; returns their names."""
    removed = []
    for line in _run("ip", "netns", "list").stdout.splitlines():
        match = re.fullmatch(rf"({PREFIX}(\d+)[sc])(\s.*)?", line.strip())
        if match and not psutil.pid_exists(int(match.group(2))):
            _run("ip", "netns", "del", match.group(1))
            removed.append(match.group(1))
    return removed


class Link:
    """Two namespaces (``server``, ``client``) joined by a veth pair, each end shaped by ``tbf``."""

    def __init__(self) -> None:
        tag = f"{PREFIX}{os.getpid()}"
        self.server, self.client = f"{tag}s", f"{tag}c"
        self.devs = {self.server: f"{tag}s", self.client: f"{tag}c"}  # a veth end is named after its namespace
        self.procs: list[subprocess.Popen[str]] = []

    def create(self) -> None:
        """Add the namespaces and the veth pair; :class:`CannotRun` when refused."""
        _check("ip", "netns", "add", self.server)
        _check("ip", "netns", "add", self.client)
        _check("ip", "link", "add", self.devs[self.server], "type", "veth", "peer", "name", self.devs[self.client])
        for ns, addr in ((self.server, SERVER_IP), (self.client, CLIENT_IP)):
            _check("ip", "link", "set", self.devs[ns], "netns", ns)
            _check("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", self.devs[ns])
            _check("ip", "-n", ns, "link", "set", self.devs[ns], "up")
            _check("ip", "-n", ns, "link", "set", "lo", "up")

    def shape(self, rate_bps: float | None) -> None:
        """Token-bucket both ends to ``rate_bps`` (``None``: remove shaping)."""
        for ns, dev in self.devs.items():
            if rate_bps is None:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root")
                continue
            # The bucket holds 1 ms at the rate, 64 KiB at least (less falls short of 1 Gbit/s here); a
            # message up to that size leaves at line rate after an idle moment, the rest at the rate.
            burst = max(64 * 1024, int(rate_bps / 8 * 0.001))
            _check("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                   "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", "100ms")

    def spawn(self, ns: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[str]:
        """Start ``argv`` inside namespace ``ns`` (ended by :meth:`delete` if still running)."""
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], text=True, **kwargs)
        self.procs.append(proc)
        return proc

    def delete(self) -> None:
        """End every process this link started, then delete both namespaces (and so the veth pair)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for ns in (self.server, self.client):
            _run("ip", "netns", "del", ns)

    def exists(self) -> bool:
        """Whether either namespace is still there."""
        names = {line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines() if line.strip()}
        return bool(names & {self.server, self.client})


@contextmanager
def link() -> Iterator[Link]:
    """A :class:`Link`, deleted on every way out (SIGTERM and SIGHUP end the run like Ctrl-C)."""
    if not sys.platform.startswith("linux"):
        raise CannotRun("network namespaces are a Linux feature")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise CannotRun(f"the `{tool}` command (iproute2) is not installed")
    if os.geteuid() != 0:
        raise CannotRun("creating network namespaces needs root")
    remove_stale_namespaces()
    handlers = {sig: signal.signal(sig, _exit_on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    pair = Link()
    try:
        pair.create()
        pair.shape(parse_rate("100mbit"))  # tbf must work before anything is measured
        yield pair
    finally:
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, *handlers})  # clean up undisturbed
        try:
            pair.delete()
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
