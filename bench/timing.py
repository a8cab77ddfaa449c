"""Timing for the benchmarks: milliseconds of a callable, CUDA synchronised on both sides, and the
device syncs a callable makes."""

from __future__ import annotations

import statistics
import time
import warnings

import torch


class Clock:
    """Milliseconds of a callable, with CUDA synchronised on both sides so queued work counts."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.cuda = torch.device(device).type == "cuda"

    def ms(self, fn) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if self.cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    def median_ms(self, fn, repeats: int, reset=None) -> float:
        """One warm-up call, then the median of ``repeats`` timed calls; ``reset`` runs untimed
        after each call."""
        times = []
        for i in range(repeats + 1):
            t = self.ms(fn)
            if reset is not None:
                reset()
            if i:
                times.append(t)
        return statistics.median(times)


def device_syncs(fn) -> int:
    """The device syncs torch reports while ``fn`` runs (CUDA; ``torch.cuda.set_sync_debug_mode``):
    each is a point where the host waits for the GPU's queued work."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)
