"""Ending a ``splitfed serve`` (or ``route``) process the way an operator does, and saying why when it does not end."""

from __future__ import annotations

import signal
import subprocess
import time


def end_on_sigterm(proc: subprocess.Popen[str], timeout: float = 60.0) -> str:
    """Send SIGTERM and wait up to ``timeout`` seconds; returns what the process wrote (its piped stdout, else its
    piped stderr). One that does not end gets SIGUSR1 (the command then writes every thread's stack to stderr), is
    killed, and the test fails with those stacks."""
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        proc.kill()
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"the server did not end within {timeout:.0f}s of SIGTERM; its threads:\n"
                             f"{(out or err or '')[-12000:]}") from None
    return out or err or ""
