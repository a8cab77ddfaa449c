"""Hops: a parked row's query goes to the retrieval worker; its evidence comes back as a block
queued behind the marker, for the next step's forward to prefill.

``HopHandler`` owns that path and nothing else: it never changes the batch (the scheduler does)
and never writes the KV (the runner does, when the queued tokens are fed; the one exception is
``append_format: summary``, which asks the runner to evict a row's earlier blocks). It changes a
sequence through the sequence's own methods: ``append`` (the block), ``finish`` and ``fail``.

* ``park``: the rows that completed a marker this step hand their queries to the worker (one
  search call for all of them), or are answered at once: from documents already in context
  (``reuse_similarity``), or with a no-evidence block (an empty query, a query that cannot be
  queued). ``wait_for`` (``sync_retrieval``) has the step wait for its searches.
* ``serve_results`` / ``time_out`` / ``serve``: a finished (or abandoned) search's hits are
  rendered into an evidence block (numbered for citations, cut to the evidence budget and to the
  context left), recorded as the hop's ``RetrievalStep`` and queued as the row's pending tokens
  (``_queue_evidence``); the row runs again. Failures stay with the row: a no-evidence block, or
  the row ends with an engine error.
* ``assemble_staged``: zero-prefill rows get their block's KV from the piece store
  (``kernels/chunk_kv.py``) instead of a forward over it.
"""

from __future__ import annotations

import math
import time

from ..citations import trace_docs
from ..evidence import number_hits
from ..memory import Reuse, find_reuse
from ..retrieval.base import Hit
from ..trace import RetrievalStep, RetrievedDoc
from .options import EngineOptions
from .retrieval_worker import RetrievalResult, RetrievalWorker
from .sequence import PendingBlock, Sequence, SequenceStatus

RUNNING, RETRIEVING = SequenceStatus.RUNNING, SequenceStatus.RETRIEVING


class _RowBroken(Exception):
    """A row's cache changed before its hop failed: the row cannot go on (``step`` records why)."""

    def __init__(self, step: RetrievalStep):
        super().__init__(step.error)
        self.step = step


class HopHandler:
    def __init__(self, worker: RetrievalWorker, formatter, runner, options: EngineOptions, chunks=None):
        """``runner``: for the context left and (summary mode) evicting old blocks; ``chunks``: the
        zero-prefill piece store, or None."""
        self.worker, self.formatter, self.runner, self.opts, self.chunks = worker, formatter, runner, options, chunks

    def assemble_staged(self, rows: dict[int, Sequence]) -> dict[int, tuple]:
        """Row -> staged KV of the zero-prefill blocks about to be spliced, assembled in one call:
        the pieces any of them lacks are computed together, in one forward. Each of those rows'
        hop waited for that call: its time (``kv_ms``) goes to each row's splice time. Per row, the
        trace says how many of its block's pieces the store held (``piece_hits``) and how many it
        had to compute (``piece_misses``, in the shared forward; a piece twice in the block counts once,
        and a document's cut text counts even when the forward computed it as the start of another
        row's whole text) and their tokens (``piece_tokens_computed``, leads not counted)."""
        rows = {i: s for i, s in rows.items() if s.staged is not None}
        if not rows:
            return {}
        t0 = time.perf_counter()
        try:
            assembled = self.chunks.blocks_kv([s.staged.pieces() for s in rows.values()])
        except Exception as e:  # noqa: BLE001 - the blocks are fed whole instead: the exact splice
            for s in rows.values():
                s.staged = None
                s.trace.retrieval_steps[-1].info["zero_prefill"]["fallback"] = (
                    f"exact splice: assembling staged KV failed ({type(e).__name__}: {e})")
            return {}
        kv_ms = (time.perf_counter() - t0) * 1e3
        for s, block in zip(rows.values(), assembled):
            s.trace.splice_ms += kv_ms
            step = s.trace.retrieval_steps[-1]
            step.splice_ms += kv_ms
            missed = block.computed
            step.info["zero_prefill"].update(piece_hits=len(block.pieces) - len(missed), piece_misses=len(missed),
                                             piece_tokens_computed=sum(len(ids) for _, ids in missed),
                                             blocks_assembled_together=len(rows), kv_ms=round(kv_ms, 3))
        return {i: (block.kv, block.shifts) for i, block in zip(rows, assembled)}

    def park(self, batch: list[Sequence], parked: list[Sequence], now: float) -> None:
        """Hand the parked rows' queries to the worker (an empty query gets no search)."""
        for s in parked:
            try:
                reuse = self._find_reuse(s)
                if reuse is not None:  # answered from documents already in context: no search
                    self.serve(batch, s, [], None, now, reuse=reuse)
                elif s.query:
                    s.ticket = self.worker.submit(s.seq_id, s.query, s.top_k, s.filters)
                else:
                    self.serve(batch, s, [], "empty query", now)
            except Exception as e:  # noqa: BLE001 - this row's hop fails alone
                self.serve(batch, s, [], f"search could not be queued: {type(e).__name__}: {e}", now)
        self.worker.flush()  # this step's queries, in one search call

    def wait_for(self, batch: list[Sequence], parked: list[Sequence], now: float) -> None:
        """Serve these rows' searches as they finish, up to the retrieval timeout from ``now``."""
        waiting = [s for s in parked if s.status is RETRIEVING]
        if not waiting:
            return
        limit = now + self.opts.retrieval_timeout_s
        while any(s.status is RETRIEVING for s in waiting) and time.perf_counter() < limit:
            self.worker.wait(max(0.0, limit - time.perf_counter()))
            self.serve_results(batch, self.worker.poll(), time.perf_counter())

    def _find_reuse(self, s: Sequence) -> Reuse | None:
        if not s.query or self.opts.reuse_similarity is None:
            return None
        try:
            return find_reuse(s.query, s.memory, s.trace, self.opts.reuse_similarity,
                              hops_in_context=self.opts.append_format != "summary")
        except Exception as e:  # noqa: BLE001 - no reuse: the query is searched
            s.hop_info["reuse_error"] = f"{type(e).__name__}: {e}"
            return None

    def serve_results(self, batch: list[Sequence], results: list[RetrievalResult], now: float) -> None:
        by_ticket = {s.ticket: s for s in batch if s.status is RETRIEVING and s.ticket}
        for r in results:
            s = by_ticket.get(r.ticket)
            if s is not None:  # else: the sequence gave up on it (timeout, cancel, deadline)
                self.serve(batch, s, r.hits, r.error, now, r.latency_ms, r.batch_size, r.attempts)

    def time_out(self, batch: list[Sequence], s: Sequence, now: float) -> None:
        """The row's search is past the retrieval timeout: it goes on without evidence."""
        self.serve(batch, s, [], f"retriever timed out after {self.opts.retrieval_timeout_s:g}s", now,
                   latency_ms=(now - s.parked_at) * 1e3)

    def serve(self, batch: list[Sequence], s: Sequence, hits: list[Hit], error: str | None, now: float,
              latency_ms: float = 0.0, batch_size: int = 0, attempts: int = 0, reuse: Reuse | None = None) -> None:
        """``_queue_evidence``, with its failures kept to the row: one that fails before changing
        anything (rendering, numbering) gets a no-evidence block with the failure recorded; a
        second failure, or one after the row's cache changed, ends the row with an engine error."""
        try:
            self._queue_evidence(batch, s, hits, error, now, latency_ms, batch_size, attempts, reuse)
            return
        except _RowBroken as e:
            s.fail("splicing its evidence", e.step.error, now, e.step)
            return
        except Exception as e:  # noqa: BLE001
            why = f"evidence could not be rendered ({type(e).__name__}: {e})"
        try:
            self._queue_evidence(batch, s, [], why if error is None else f"{error}; {why}", now, latency_ms,
                                 batch_size, attempts)
        except Exception as e:  # noqa: BLE001
            s.fail("splicing a no-evidence block", e.__cause__ or e, now)

    def _queue_evidence(self, batch: list[Sequence], s: Sequence, hits: list[Hit], error: str | None, now: float,
                        latency_ms: float = 0.0, batch_size: int = 0, attempts: int = 0,
                        reuse: Reuse | None = None) -> None:
        """Queue the evidence block behind the marker-completing token; the row runs again.

        All or nothing: the step and the block are built first, touching nothing; then (summary
        mode) the old evidence leaves the cache, and the row's state changes by appends alone."""
        step = RetrievalStep(s.matcher.num_markers, s.query or "", latency_ms=latency_ms, batch_size=batch_size,
                             position=len(s.token_ids), error=error)
        step.info = {**getattr(hits, "info", {}), **s.hop_info}
        if attempts > 1:
            step.info["attempts"] = attempts
        if reuse is not None:
            step.info["reuse"] = {"similarity": reuse.similarity, "query": reuse.query, "numbers": reuse.numbers}
        step.fallback = step.info.get("fallback")
        if reuse is None and (error or step.info.get("empty")):
            step.fallback = "no-evidence block" if error else f"{step.fallback}; no-evidence block"
        summary = self.opts.append_format == "summary"
        freed = sum(e - b for b, e in s.evidence_spans) if summary else 0
        room = self.runner.context_limit - (s.num_kept - freed) - 1
        numbers = number_hits(hits, {d.id: d.number for d in trace_docs(s.trace)})
        try:
            block = (self.formatter.render_reference(reuse.numbers, budget=room) if reuse is not None
                     else self.formatter.render_block(hits, step.round, budget=room, numbers=numbers))
        except ValueError:
            step.error = "context full: no room for evidence"
            step.fallback = "no evidence: finished"
            s.finish("context_full", now, step)
            return
        # the block renders hits in order, up to its budget
        step.docs = [RetrievedDoc(h.doc_id, h.title, h.score, h.source, n, text)
                     for h, n, text in zip(hits, numbers, block.shown)]
        if block.truncated:
            step.info["evidence_cut"] = True
        step.evidence_tokens = len(block.token_ids)
        if summary:
            try:
                self._drop_old_evidence(batch.index(s), s, step)
            except Exception as e:  # the row's cache may be partly moved: it cannot go on
                step.error = f"summary eviction failed: {type(e).__name__}: {e}"
                step.fallback = "no evidence: finished"
                raise _RowBroken(step) from e
        s.hop_info = {}
        s.trace.retrieval_steps.append(step)
        s.trace.retrieval_ms += latency_ms
        s.trace.parked_ms += (now - s.parked_at) * 1e3
        s.ticket = 0
        s.trace.evidence_tokens += len(block.token_ids)
        s.evidence_spans.append((len(s.token_ids), len(s.token_ids) + len(block.token_ids)))
        if self.chunks is not None and not self.opts.reprefill:
            n = len(block.token_ids)
            recompute = max(1, math.ceil(self.opts.zero_prefill_recompute * n))
            # tail: the first tokens are reused, the rest fed; deviation: all but the last reused,
            # and the most deviating of them recomputed in place (the runner picks them).
            count = n - recompute if self.opts.zero_prefill_select == "tail" or recompute == n else n - 1
            if count > 0:  # assembled at the next step, with the other rows splicing then
                s.staged = PendingBlock(block.token_ids, block.segments, count, block.leads,
                                        reselect=recompute - (n - count))
                step.info["zero_prefill"] = {"reused_tokens": n - recompute, "recomputed_tokens": recompute,
                                             "select": self.opts.zero_prefill_select}
        s.append(block.token_ids, sampled=False)
        s.status, s.query = RUNNING, None

    def _drop_old_evidence(self, row: int, s: Sequence, step: RetrievalStep) -> None:
        """Summary mode: the evidence blocks the row holds leave its cache (the reference mode only
        records it: the row's re-prefill leaves them out). Each span is recorded as it goes, so
        the row's bookkeeping matches its cache whatever fails."""
        dropped = 0
        while s.evidence_spans:
            start, end = s.evidence_spans[0]
            if not self.opts.reprefill:
                at = s.kept_index(start)
                self.runner.evict(row, at, at + end - start)
            s.evicted.append(s.evidence_spans.pop(0))
            dropped += end - start
            step.info["evicted_tokens"] = dropped
            s.trace.evicted_tokens += end - start
