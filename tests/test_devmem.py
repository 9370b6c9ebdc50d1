"""When the trunk server frees a region's GPU memory: only once its client let go of it or its process is gone
(freeing memory another process still maps is undefined behaviour in CUDA). Pure bookkeeping: runs without a GPU;
the CUDA side is in tests/test_cuda.py."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from splitfed.channel.transports.shm import devmem


class _Block:
    """Stands in for a DeviceMemory: records when the server lets go of it."""

    def __init__(self, nbytes: int = 4096) -> None:
        self.nbytes = nbytes
        self.closed = False

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def client() -> Iterator[subprocess.Popen]:
    """A live process standing in for a client that maps a block; killed (and reaped) after the test."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def _retire(name: str, block: _Block, owner: str, proc: subprocess.Popen, **kw: bool) -> None:
    devmem.retire(name, block, owner, proc.pid, devmem.process_start(proc.pid), **kw)


def test_process_start_tells_a_process_from_none() -> None:
    assert devmem.process_start(os.getpid()) is not None
    assert devmem.process_start(2 ** 22 + 7) is None  # above pid_max: no such process
    assert devmem.may_map(os.getpid())
    assert not devmem.may_map(0) and not devmem.may_map(-1) and not devmem.may_map(2 ** 22 + 7)


def test_a_block_waits_for_its_live_client_and_goes_with_its_process(client: subprocess.Popen) -> None:
    block = _Block()
    _retire("splitfed-a", block, "alice", client)
    assert not block.closed and devmem.parked_bytes() >= 4096  # the client may still map it
    devmem.sweep()
    assert not block.closed
    client.kill()
    client.wait()
    devmem.sweep()
    assert block.closed  # its process is gone: nothing maps it any more


def test_only_its_own_client_releases_a_waiting_block(client: subprocess.Popen) -> None:
    block = _Block()
    _retire("splitfed-b", block, "alice", client)
    devmem.release("splitfed-b", "bob")
    assert not block.closed
    devmem.release("splitfed-b", "alice")  # alice closed the region: she unmapped first
    assert block.closed


def test_a_released_or_local_or_reused_pid_block_goes_at_once(client: subprocess.Popen) -> None:
    released, local, reused = _Block(), _Block(), _Block()
    _retire("splitfed-c", released, "alice", client, released=True)
    devmem.retire("splitfed-d", local, "alice", os.getpid(), devmem.process_start(os.getpid()))
    devmem.retire("splitfed-e", reused, "alice", client.pid, "0")  # the pid is another process's now
    assert released.closed and local.closed and reused.closed


def test_blocks_kept_for_a_client_count_against_its_share(client: subprocess.Popen) -> None:
    _retire("splitfed-f", _Block(3 << 20), "carol", client)
    # RegionTable.open adds these to the client's regions when it decides whether a new one gets a block.
    assert devmem.parked_bytes("carol") == 3 << 20 and devmem.parked_bytes("dave") == 0
    client.kill()
    client.wait()
    devmem.sweep()
    assert devmem.parked_bytes("carol") == 0
