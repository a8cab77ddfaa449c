"""Retrieval off the decode path: a search thread that batches every query waiting for it, and
that nothing a retriever does can stop.

The engine submits a query when a sequence completes a marker and goes on decoding the other rows.
The search thread (the *lane*) takes *all* queries submitted since its last call into one
``search_batch`` call, retries a failing call a bounded number of times, checks what came back
(``retrieval.validate``) and hands the results to ``poll``. Each submission gets a ticket: a result
whose ticket the engine already gave up on (timeout, cancellation) is simply dropped.

Faults stay in the batch they hit:

- whatever the retriever raises or returns, every ticket of the call gets a result (hits, or an
  error saying why not); the lane catches everything, its own bugs included;
- a call still running ``timeout_s`` after it started is abandoned: its tickets get timeout
  results at once and a new lane takes the queue. The abandoned thread is left to finish (Python
  cannot stop it); what it returns is dropped. While ``max_hung`` abandoned calls are still
  running, retrieval is *degraded* (``health()``): no new lane starts and every query gets an
  immediate error result instead of a wait; it recovers by itself when a hung call returns;
- a lane that dies anyway is noticed at the engine's next ``poll``: its tickets get error results
  and another lane starts.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..retrieval.base import Hit, HitList, Retriever
from ..retrieval.validate import check_results


@dataclass(slots=True)
class RetrievalResult:
    ticket: int
    seq_id: int
    hits: list[Hit] = field(default_factory=list)
    error: str | None = None
    latency_ms: float = 0.0
    batch_size: int = 0
    attempts: int = 1


@dataclass(slots=True)
class Job:
    """One submitted query: its ticket, whose it is, and how many hits it wants."""

    ticket: int
    seq_id: int
    query: str
    top_k: int
    filters: dict | None = None
    """Metadata filters of this query's search (its API key's namespace), over the retriever's own."""

    def failed(self, error: str, ms: float, batch_size: int, attempts: int = 1) -> RetrievalResult:
        return RetrievalResult(self.ticket, self.seq_id, [], error, ms, batch_size, attempts)


@dataclass(eq=False, slots=True)
class _Lane:
    thread: threading.Thread | None = None
    batch: list[Job] | None = None
    """The call in flight (None: idle)."""
    started: float = 0.0


class RetrievalWorker:
    def __init__(self, retriever: Retriever | None, top_k: int, retries: int = 1, timeout_s: float = 10.0,
                 max_hung: int = 4):
        if max_hung < 1:
            raise ValueError(f"max_hung must be at least 1, got {max_hung}")
        self.retriever, self.top_k, self.retries = retriever, top_k, retries
        self.timeout_s, self.max_hung = timeout_s, max_hung
        self._pending: list[Job] = []  # submitted, not yet flushed
        self._queue: list[Job] = []
        self._done: list[RetrievalResult] = []
        self._cond = threading.Condition()
        self._closed = False
        self._next_ticket = 0
        self._lane: _Lane | None = None
        self._hung: set[_Lane] = set()
        self.calls = 0
        self.num_abandoned = 0
        """Calls abandoned past ``timeout_s`` (since start)."""
        self.num_restarts = 0
        """Lanes that died and were replaced."""
        self.on_result: Callable[[], None] | None = None
        """Called whenever results are ready (from the search thread, too): the engine's runner
        stops waiting for tokens to serve them."""

    # -- the engine's side --------------------------------------------------------------------------

    def submit(self, seq_id: int, query: str, top_k: int | None = None, filters: dict | None = None) -> int:
        """Queue a query (``top_k``: this one's result count, default the worker's; ``filters``: its
        search's metadata filters). It is searched from the next ``flush`` (or ``poll``/``wait``) on,
        with every query submitted before it: one step's queries go to the retriever in one call
        (one per distinct ``filters``)."""
        with self._cond:
            self._next_ticket += 1
            job = Job(self._next_ticket, seq_id, query, top_k or self.top_k, filters or None)
            refusal = "no retriever configured" if self.retriever is None else self._degraded_reason()
            if refusal:  # answered now: the hop gets its no-evidence block without a wait
                self._done.append(job.failed(refusal, 0.0, 0, 0))
            else:
                self._pending.append(job)
            return job.ticket

    def flush(self) -> None:
        """Hand the queries submitted so far to the search thread."""
        with self._cond:
            self._supervise()

    def poll(self) -> list[RetrievalResult]:
        with self._cond:
            self._supervise()
            out, self._done = self._done, []
            return out

    def wait(self, timeout: float) -> None:
        """Block until a result is ready (or ``timeout`` seconds pass, or a call falls overdue)."""
        with self._cond:
            if not self._done:
                lane = self._lane
                if lane is not None and lane.batch is not None:
                    timeout = min(timeout, max(0.0, lane.started + self.timeout_s - time.perf_counter()) + 1e-3)
                self._cond.wait(timeout)
            self._supervise()

    def health(self) -> dict:
        """``status`` ok | degraded, and why; counts of hung, abandoned and restarted searches."""
        with self._cond:
            reason = self._degraded_reason()
            return {"status": "degraded" if reason else "ok", "reason": reason, "hung_searches": len(self._hung),
                    "abandoned_searches": self.num_abandoned, "restarts": self.num_restarts, "calls": self.calls,
                    "queued": len(self._queue) + len(self._pending)}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- supervision (under the lock) ---------------------------------------------------------------

    def _degraded_reason(self) -> str | None:
        if len(self._hung) < self.max_hung:
            return None
        return (f"retrieval degraded: {len(self._hung)} searches still running past timeout_s "
                f"({self.timeout_s:g}s; at most {self.max_hung} may hang)")

    def _supervise(self) -> None:
        """Abandon an overdue call, replace a dead lane, start a lane for queued queries."""
        if self._pending:
            self._queue += self._pending
            self._pending = []
            self._cond.notify_all()
        lane, now = self._lane, time.perf_counter()
        if lane is not None and lane.batch is not None and now - lane.started > self.timeout_s:
            self._fail(lane.batch, f"retriever timed out after {self.timeout_s:g}s (search abandoned)",
                       now - lane.started)
            self._hung.add(lane)
            self._lane = None
            self.num_abandoned += 1
        elif lane is not None and not lane.thread.is_alive() and not self._closed:
            if lane.batch:
                self._fail(lane.batch, "retrieval thread ended unexpectedly; restarted", now - lane.started)
            self._lane = None
            self.num_restarts += 1
        reason = self._degraded_reason()
        if reason and self._queue:
            self._fail(self._queue, reason, 0.0)
            self._queue = []
        if self._lane is None and self._queue and not self._closed:
            self._lane = _Lane()
            self._lane.thread = threading.Thread(target=self._run, args=(self._lane,), name="rig-retrieval",
                                                 daemon=True)
            self._lane.thread.start()

    def _fail(self, batch: list[Job], error: str, seconds: float) -> None:
        self._done += [job.failed(error, seconds * 1e3, len(batch)) for job in batch]
        self._results_ready()

    def _results_ready(self) -> None:
        self._cond.notify_all()
        if self.on_result is not None:
            self.on_result()

    # -- the lane -----------------------------------------------------------------------------------

    def _run(self, me: _Lane) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed and self._lane is me:
                    self._cond.wait()
                if self._closed or self._lane is not me:
                    return
                # one search call per distinct filters (API keys' namespaces): the first query's
                # group now, the others stay queued, each under its own timeout
                group = _group(self._queue[0])
                batch = [job for job in self._queue if _group(job) == group]
                self._queue = [job for job in self._queue if _group(job) != group]
                me.batch, me.started = batch, time.perf_counter()
            try:
                results = self._search(me, batch)
            except BaseException as e:  # noqa: BLE001 - a bug of ours fails the batch, not the lane
                results = [job.failed(f"retrieval failed: {type(e).__name__}: {_clip(str(e))}", 0.0, len(batch))
                           for job in batch]
            with self._cond:
                self.calls += 1
                if self._lane is not me:  # abandoned while searching: its tickets have their results
                    self._hung.discard(me)
                    self._cond.notify_all()
                    return
                self._done += results
                me.batch = None
                self._results_ready()

    def _search(self, me: _Lane, batch: list[Job]) -> list[RetrievalResult]:
        """One search for the batch (queries with the same filters), at its largest ``top_k``; each
        query keeps its own."""
        t0 = time.perf_counter()
        queries, filters = [job.query for job in batch], batch[0].filters
        extra = (filters,) if filters else ()
        checked, error, attempts = None, None, 0
        while attempts <= self.retries and self._lane is me:
            attempts += 1
            try:
                raw = self.retriever.search_batch(queries, max(job.top_k for job in batch), *extra)
                checked, error = check_results(raw, len(queries)), None
                break
            except BaseException as e:  # noqa: BLE001 - whatever a retriever raises becomes a recorded hop
                checked, error = None, f"retriever failed: {type(e).__name__}: {_clip(str(e))}"
        ms = (time.perf_counter() - t0) * 1e3
        attempts = max(1, attempts)
        if checked is None:
            return [job.failed(error, ms, len(batch), attempts) for job in batch]
        out = []
        for job, hits in zip(batch, checked):
            if isinstance(hits, str):
                out.append(job.failed(hits, ms, len(batch), attempts))
            else:  # each keeps its HitList (the retriever's per-query decisions), cut to its top_k
                out.append(RetrievalResult(job.ticket, job.seq_id, HitList(hits[:job.top_k], hits.info), None, ms,
                                           len(batch), attempts))
        return out


def _group(job: Job) -> str:
    return json.dumps(job.filters, sort_keys=True, default=str)


def _clip(text: str, n: int = 300) -> str:
    return text if len(text) <= n else text[:n] + "..."
