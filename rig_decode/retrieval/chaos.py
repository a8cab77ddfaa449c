"""A retriever that misbehaves on purpose: for fault-injection tests and ``bench/chaos.py``.

``FaultyRetriever(inner, plan)`` asks ``plan(call_number, queries)`` before every ``search_batch``
call which fault to inject (``None``: none) and records each one it injected. The modes are what
real retrievers do wrong:

    raise      the call raises
    too_few    one result list fewer than queries
    none       ``None`` in place of every query's list
    nan        a hit with a NaN score beside the real ones
    huge       a 20,000-word document first
    text_none  a hit whose text is ``None`` beside the real ones
    non_hit    a string in the hit list beside the real ones
    hang       the call blocks until ``release()`` (or ``hang_s``)
    slow       the call sleeps ``slow_s``, then answers normally (not a fault: a slow backend)

``fault_recorded(mode, step)`` says whether a hop's trace shows the fault it was dealt.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from .base import Hit, HitList, Retriever

FAULTS = ("raise", "too_few", "none", "nan", "huge", "text_none", "non_hit", "hang")
MODES = (*FAULTS, "slow")
HUGE_WORDS = 20_000


@dataclass(slots=True)
class Injected:
    call: int
    mode: str
    queries: list[str]


class FaultyRetriever:
    def __init__(self, inner: Retriever, plan, hang_s: float = 60.0, slow_s: float = 0.1):
        self.inner, self.plan, self.hang_s, self.slow_s = inner, plan, hang_s, slow_s
        self.injected: list[Injected] = []
        self.num_calls = 0
        self._released = threading.Event()
        self._lock = threading.Lock()

    def release(self) -> None:
        """Let every hung call return (and later ones not hang)."""
        self._released.set()

    def search_batch(self, queries, top_k, filters=None):
        with self._lock:
            self.num_calls += 1
            call = self.num_calls
        mode = self.plan(call, list(queries))
        if mode is not None:
            if mode not in MODES:
                raise ValueError(f"unknown fault mode {mode!r}; one of {MODES}")
            with self._lock:
                self.injected.append(Injected(call, mode, list(queries)))
        if mode == "raise":
            raise RuntimeError("injected fault: the index server went away")
        if mode == "hang":
            self._released.wait(self.hang_s)
        if mode == "slow":
            time.sleep(self.slow_s)
        if mode == "none":
            return [None] * len(queries)
        results = self.inner.search_batch(queries, top_k, filters)
        if mode == "too_few":
            return list(results)[:-1]
        return [_spoil(hits, mode) for hits in results] if mode in ("nan", "huge", "text_none", "non_hit") else results

    def __getattr__(self, name):  # knows(), close() ... of the wrapped retriever
        return getattr(self.inner, name)


def _spoil(hits: list[Hit], mode: str) -> list:
    info = dict(getattr(hits, "info", {}))
    hits = list(hits)
    if mode == "nan":
        return HitList([*hits, Hit("nan-doc", "A document scored NaN.", float("nan"))], info)
    if mode == "huge":
        return HitList([Hit("huge-doc", " ".join(["word"] * HUGE_WORDS), 1.0, title="Huge"), *hits], info)
    if mode == "text_none":
        return HitList([*hits, Hit("none-text", None, 0.5)], info)  # type: ignore[arg-type]
    return HitList([*hits, "not a hit"], info)


def fault_recorded(mode: str, step) -> bool:
    """Whether a hop's ``RetrievalStep`` shows the fault ``mode`` (any error counts: a fault can
    also end in a timeout, a degraded refusal or the row's deadline)."""
    info = step.info if hasattr(step, "info") else step.get("info", {})
    error = step.error if hasattr(step, "error") else step.get("error")
    if error or info.get("attempts", 1) > 1:  # a failed first attempt that a retry mended is recorded too
        return True
    if mode in ("nan", "text_none", "non_hit"):
        return info.get("dropped_hits", 0) > 0
    if mode == "huge":
        return info.get("clipped_texts", 0) > 0
    return mode == "slow"
