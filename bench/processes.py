"""Ending what a benchmark or test run started: a SuperLink, Ray, their children."""

from __future__ import annotations

import os
import signal


def end_processes_of(*markers: str) -> None:
    """End every process whose command line names one of ``markers`` or whose ``FLWR_HOME`` is one of them,
    with their children: SIGTERM, then SIGKILL for those still alive after 10 s."""
    import psutil

    procs = []
    for p in psutil.process_iter(["pid", "cmdline", "environ"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            env = p.info.get("environ") or {}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if p.pid != os.getpid() and (any(m in cmd for m in markers) or env.get("FLWR_HOME") in markers):
            procs.append(p)
    for p in list(procs):
        try:
            procs.extend(p.children(recursive=True))
        except psutil.NoSuchProcess:  # it ended between the scan and now
            pass
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
