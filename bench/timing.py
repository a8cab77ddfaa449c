"""Timing for the benchmarks: milliseconds of a callable, CUDA synchronised on both sides, the
device syncs a callable makes, the device to time on, and the re-prefill several of them time."""

from __future__ import annotations

import statistics
import time
import warnings

import torch
from transformers import DynamicCache

from rig_decode.models.cache_arg import cache_kw


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


def pick_device(choice: str) -> torch.device:
    """The device for ``--device auto|cpu|cuda`` (auto: CUDA when there is one), CUDA with its
    index (memory calls want one); exits when CUDA is asked for and missing."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    if choice == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


@torch.no_grad()
def forward_alone(model, ids: torch.Tensor) -> None:
    """One forward over ``ids`` (``[1, n]``) from an empty cache, logits of the last token only: a
    re-prefill, what string-based RIG systems pay at every hop."""
    model(input_ids=ids, **cache_kw(DynamicCache(config=model.config)), use_cache=True, logits_to_keep=1)
