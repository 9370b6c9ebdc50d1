"""``DeviceIO.host_buffer``'s bookkeeping on any machine: streamed requests gather in pool buffers up to a cap, and
a buffer goes back only once no view of its bytes is left. (With a GPU, ``tests/test_gpu_server.py`` checks the
same with pinned memory and trains over streamed requests gathered so.)"""

from __future__ import annotations

import gc

import torch

from splitfed.trunk.device import pinned
from splitfed.trunk.device.transfers import DeviceIO, PinnedPool


class _HostPool(PinnedPool):
    """A pool whose buffers are pageable: page-locking needs a GPU, the lending does not."""

    def take(self, nbytes: int) -> torch.Tensor:
        size = pinned._size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                self._idle -= size
                return free.pop()
            self.allocated += 1
        return torch.empty(size, dtype=torch.uint8)


def test_streams_gather_in_pool_buffers_up_to_a_cap_and_return_them_when_no_view_is_left() -> None:
    io = DeviceIO("cpu", _HostPool())
    io.max_gathering = 1 << 20
    first = io.host_buffer(600_000)
    assert io._gathering == 600_000 and io.pool.allocated == 1
    over = io.host_buffer(600_000)  # past the cap: memory of numpy's own, not lent from the pool
    assert io._gathering == 600_000 and io.pool.allocated == 1 and over.flags.owndata
    view = torch.frombuffer(memoryview(first)[1000:2000], dtype=torch.uint8)
    del first
    gc.collect()
    assert io._gathering == 600_000  # a view of its bytes lives: still lent
    del view
    gc.collect()
    assert io._gathering == 0
    again = io.host_buffer(600_000)
    assert len(again) == 600_000 and io.pool.allocated == 1 and io._gathering == 600_000  # the same buffer, reused
