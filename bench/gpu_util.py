"""GPU utilization sampled while a benchmark runs: NVML through ``torch.cuda.utilization``, else ``nvidia-smi``.

NVML's figure is the share of the last sample period (1/6 s to 1 s, by card) in which a kernel ran, the figure
``nvidia-smi`` prints: a card busy with one small kernel at a time reads 100%, so it bounds from above how busy
the GPU was.
"""

from __future__ import annotations

import logging
import shutil
import statistics
import subprocess
import threading
import time
from typing import Any

import torch

log = logging.getLogger(__name__)


class UtilSampler:
    """Samples the utilization of ``device`` every ``period_s`` between :meth:`start` and :meth:`stop`."""

    def __init__(self, device: str | torch.device, period_s: float = 0.1) -> None:
        self.device = torch.device(device)
        self.period_s = period_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._smi: subprocess.Popen[str] | None = None
        self.source = "none"

    def _nvml(self) -> bool:
        try:
            torch.cuda.utilization(self.device)
        except Exception:  # noqa: BLE001 - pynvml missing or NVML unusable: try nvidia-smi
            return False
        return True

    def start(self) -> UtilSampler:
        """Start sampling (nothing on a CPU device, or where neither NVML nor nvidia-smi answers)."""
        if self.device.type != "cuda":
            return self
        if self._nvml():
            self.source = "nvml"
            self._thread = threading.Thread(target=self._poll, name="gpu-util", daemon=True)
            self._thread.start()
        elif shutil.which("nvidia-smi"):
            self.source = "nvidia-smi"
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self._smi = subprocess.Popen(
                ["nvidia-smi", f"--id={index}", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                 f"-lms={max(int(self.period_s * 1000), 50)}"], stdout=subprocess.PIPE, text=True)
            self._thread = threading.Thread(target=self._read, name="gpu-util", daemon=True)
            self._thread.start()
        else:
            log.warning("no NVML and no nvidia-smi: GPU utilization is not sampled")
        return self

    def _poll(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append(float(torch.cuda.utilization(self.device)))

    def _read(self) -> None:
        assert self._smi is not None and self._smi.stdout is not None
        for line in self._smi.stdout:
            if self._stop.is_set():
                break
            try:
                self.samples.append(float(line.strip()))
            except ValueError:
                continue

    def stop(self) -> dict[str, Any]:
        """Stop; returns the mean and max utilization in percent and the number of samples."""
        self._stop.set()
        if self._smi is not None:
            self._smi.terminate()
            self._smi.wait(5)
        if self._thread is not None:
            self._thread.join(5)
        if not self.samples:
            return {}
        return {"mean": statistics.fmean(self.samples), "max": max(self.samples), "samples": len(self.samples),
                "source": self.source}


def sampled(device: str, fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """``fn(*args, **kwargs)`` with the utilization of ``device`` sampled meanwhile: (its result, the figures)."""
    sampler = UtilSampler(device).start()
    start = time.perf_counter()
    try:
        result = fn(*args, **kwargs)
    finally:
        figures = sampler.stop()
    figures["seconds"] = time.perf_counter() - start
    return result, figures
