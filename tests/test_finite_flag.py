"""FiniteFlag: a device tensor's NaN/Inf check, read later without waiting for the work queued after it."""

from __future__ import annotations

import time

import pytest
import torch

from splitfed.codec.finite import FiniteFlag

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
def test_a_flag_says_whether_the_tensor_was_finite(bad: float | None) -> None:
    t = torch.randn(64, 8)
    if bad is not None:
        t[5, 3] = bad
    assert FiniteFlag.of(t).read() is (bad is None)


@cuda
@pytest.mark.parametrize("bad", [None, float("nan")])
def test_a_flag_on_the_gpu_is_read_while_later_work_still_runs(bad: float | None) -> None:
    # Prepare: a checked tensor, then about a second of work queued behind its check on the same stream
    t = torch.randn(1024, 1024, device="cuda")
    if bad is not None:
        t[7, 9] = bad
    torch.cuda.synchronize()
    flag = FiniteFlag.of(t)
    t.add_(1.0)  # the tensor changes after its check: the flag keeps what it held when checked
    torch.cuda._sleep(4_000_000_000)
    later = torch.cuda.Event()
    later.record()
    # Execute
    start = time.perf_counter()
    ok = flag.read()
    waited = time.perf_counter() - start
    # Assert: the answer came before the work queued after the check was done
    assert ok is (bad is None)
    assert not later.query()
    assert waited < 0.5
    torch.cuda.synchronize()
