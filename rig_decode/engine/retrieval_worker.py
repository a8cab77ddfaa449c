"""Retrieval off the decode path: one thread that batches every query waiting for it.

The engine submits a query when a sequence completes a marker and goes on decoding the other rows.
The worker takes *all* queries submitted since its last call into one ``search_batch`` call, retries
a failing call a bounded number of times, and hands results back through ``poll``. Each submission
gets a ticket: a result whose ticket the engine already gave up on (timeout, cancellation) is
simply dropped.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from ..retrieval.base import Hit, HitList, Retriever


@dataclass(slots=True)
class RetrievalResult:
    ticket: int
    seq_id: int
    hits: list[Hit] = field(default_factory=list)
    error: str | None = None
    latency_ms: float = 0.0
    batch_size: int = 0
    attempts: int = 1


class RetrievalWorker:
    def __init__(self, retriever: Retriever | None, top_k: int, retries: int = 1):
        self.retriever, self.top_k, self.retries = retriever, top_k, retries
        self._queue: list[tuple[int, int, str, int]] = []
        self._done: list[RetrievalResult] = []
        self._cond = threading.Condition()
        self._closed = False
        self._next_ticket = 0
        self.calls = 0
        self._thread = threading.Thread(target=self._loop, name="rig-retrieval", daemon=True)
        self._thread.start()

    def submit(self, seq_id: int, query: str, top_k: int | None = None) -> int:
        """Queue a query (``top_k``: this one's result count, default the worker's)."""
        with self._cond:
            self._next_ticket += 1
            self._queue.append((self._next_ticket, seq_id, query, top_k or self.top_k))
            self._cond.notify_all()
            return self._next_ticket

    def poll(self) -> list[RetrievalResult]:
        with self._cond:
            out, self._done = self._done, []
            return out

    def wait(self, timeout: float) -> None:
        """Block until a result is ready (or ``timeout`` seconds pass)."""
        with self._cond:
            if not self._done:
                self._cond.wait(timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                batch, self._queue = self._queue, []
            results = self._search(batch)
            with self._cond:
                self._done += results
                self._cond.notify_all()

    def _search(self, batch: list[tuple[int, int, str, int]]) -> list[RetrievalResult]:
        """One search for the whole batch, at its largest ``top_k``; each query keeps its own."""
        t0 = time.perf_counter()
        queries = [q for _, _, q, _ in batch]
        hits, error, attempts = None, None, 0
        if self.retriever is None:
            error = "no retriever configured"
        while self.retriever is not None and attempts <= self.retries:
            attempts += 1
            try:
                hits = self.retriever.search_batch(queries, max(k for *_, k in batch))
                if len(hits) != len(queries):
                    raise RuntimeError(f"retriever returned {len(hits)} result lists for {len(queries)} queries")
                error = None
                break
            except Exception as e:  # noqa: BLE001 - any retriever failure becomes a recorded, empty hop
                error = f"retriever failed: {type(e).__name__}: {e}"
                hits = None
        self.calls += 1
        ms = (time.perf_counter() - t0) * 1e3
        if hits is None:
            return [RetrievalResult(t, sid, [], error, ms, len(batch), max(1, attempts)) for t, sid, _, _ in batch]
        # each result keeps its HitList (with the retriever's per-query decisions), cut to its top_k
        return [RetrievalResult(t, sid, _first(h, k), None, ms, len(batch), attempts)
                for (t, sid, _, k), h in zip(batch, hits)]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()



def _first(hits: list[Hit], k: int) -> list[Hit]:
    return hits if len(hits) <= k else HitList(hits[:k], dict(getattr(hits, "info", {})))
