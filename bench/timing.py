"""Timing for the benchmarks: milliseconds of a callable, CUDA synchronised on both sides, the
device syncs a callable makes, the device to time on and a cap on its memory, and the prefills
several of them time from (a re-prefill, a runner holding random prompts)."""

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


def syncs_if_cuda(clock: Clock, fn, reset=None) -> int | None:
    """``device_syncs(fn)`` on CUDA, then ``reset()``; None elsewhere (torch reports syncs on CUDA
    only), where neither runs."""
    if not clock.cuda:
        return None
    count = device_syncs(fn)
    if reset is not None:
        reset()
    return count


def pick_device(choice: str) -> torch.device:
    """The device for ``--device auto|cpu|cuda`` (auto: CUDA when there is one), CUDA with its
    index (memory calls want one); exits when CUDA is asked for and missing."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    if choice == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def outside_torch(device: torch.device) -> int:
    """Bytes the card holds outside torch's allocator: the CUDA context, kernel images, FAISS."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def cap_memory(device: torch.device, card_bytes: int | None) -> None:
    """Limit torch's allocator on ``device`` so that it and what the card holds outside it now fit
    ``card_bytes`` (an allocation beyond raises OOM); nothing on CPU or without a cap."""
    if device.type == "cuda" and card_bytes:
        cap_bytes = card_bytes - outside_torch(device)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(max(0.0, min(1.0, cap_bytes / total)), device)


@torch.no_grad()
def forward_alone(model, ids: torch.Tensor) -> None:
    """One forward over ``ids`` (``[1, n]``) from an empty cache, logits of the last token only: a
    re-prefill, what string-based RIG systems pay at every hop."""
    model(input_ids=ids, **cache_kw(DynamicCache(config=model.config)), use_cache=True, logits_to_keep=1)


def random_ids(gen: torch.Generator, vocab: int, n: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=gen).tolist()


@torch.no_grad()
def prefill(model, prompts: list[list[int]], kv_budget: int | None = None):
    """A runner holding these prompts, and the logits after each; its KV buffers bounded by
    ``kv_budget`` tokens, as the engine bounds them. Without prefix sharing: for a lone prompt the
    runner would also keep the prompt's KV as a reusable prefix, a second copy a planned KV budget
    does not count."""
    from rig_decode.engine import HFModelRunner  # only these benchmarks need the engine

    runner = HFModelRunner(model, pad_id=0, max_slots=kv_budget)
    runner.reset(0)
    return runner, runner.step(runner.add_rows(prompts, share_prefix=False))
