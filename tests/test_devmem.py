"""When the trunk server frees a region's GPU memory: only once its client let go of it or its process is gone
(freeing memory another process still maps is undefined behaviour in CUDA). Pure bookkeeping: runs without a GPU;
the CUDA side is in tests/test_cuda.py."""

from __future__ import annotations

import os
import subprocess
import sys

from splitfed.channel import devmem


class _Block:
    """Stands in for a DeviceMemory: records when the server lets go of it."""

    def __init__(self, nbytes: int = 4096) -> None:
        self.nbytes = nbytes
        self.closed = False

    def close(self, name: str = "") -> None:
        self.closed = True


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_process_start_tells_a_process_from_none() -> None:
    assert devmem.process_start(os.getpid()) is not None
    assert devmem.process_start(2 ** 22 + 7) is None  # above pid_max: no such process
    assert devmem.may_map(os.getpid())
    assert not devmem.may_map(0) and not devmem.may_map(-1) and not devmem.may_map(2 ** 22 + 7)


def test_a_block_waits_for_its_live_client_and_goes_with_its_process() -> None:
    proc = _sleeper()
    try:
        block = _Block()
        devmem.retire("splitfed-a", block, "alice", proc.pid, devmem.process_start(proc.pid))
        assert not block.closed and devmem.parked_bytes() >= 4096  # the client may still map it
        devmem.sweep()
        assert not block.closed
    finally:
        proc.kill()
        proc.wait()
    devmem.sweep()
    assert block.closed  # its process is gone: nothing maps it any more


def test_only_its_own_client_releases_a_waiting_block() -> None:
    proc = _sleeper()
    try:
        block = _Block()
        devmem.retire("splitfed-b", block, "alice", proc.pid, devmem.process_start(proc.pid))
        devmem.release("splitfed-b", "bob")
        assert not block.closed
        devmem.release("splitfed-b", "alice")  # alice closed the region: she unmapped first
        assert block.closed
    finally:
        proc.kill()
        proc.wait()


def test_a_released_or_local_or_reused_pid_block_goes_at_once() -> None:
    proc = _sleeper()
    try:
        released = _Block()
        devmem.retire("splitfed-c", released, "alice", proc.pid, devmem.process_start(proc.pid), released=True)
        local = _Block()
        devmem.retire("splitfed-d", local, "alice", os.getpid(), devmem.process_start(os.getpid()))
        reused = _Block()  # the pid now belongs to another process than the one that mapped the block
        devmem.retire("splitfed-e", reused, "alice", proc.pid, "0")
        assert released.closed and local.closed and reused.closed
    finally:
        proc.kill()
        proc.wait()


def test_blocks_kept_for_a_client_count_against_its_share() -> None:
    proc = _sleeper()
    try:
        devmem.retire("splitfed-f", _Block(3 << 20), "carol", proc.pid, devmem.process_start(proc.pid))
        # RegionTable.open adds these to the client's regions when it decides whether a new one gets a block.
        assert devmem.parked_bytes("carol") == 3 << 20 and devmem.parked_bytes("dave") == 0
    finally:
        proc.kill()
        proc.wait()
    devmem.sweep()
    assert devmem.parked_bytes("carol") == 0
