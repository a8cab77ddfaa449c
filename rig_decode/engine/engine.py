"""The retrieval-interleaved decode loop with continuous batching.

Sequence states::

    WAITING --admitted--> RUNNING --marker--> RETRIEVING --evidence--> RUNNING --> FINISHED
       (queue, KV budget)          (parked; the other rows go on decoding)       (stop, length,
                                                                                  deadline, cancelled...)

``step()`` = schedule -> run -> postprocess:

1. schedule: take the evidence the retrieval worker has finished (each becomes that row's pending
   tokens: the marker-completing token plus the evidence block), give up on searches past their
   timeout (a no-evidence block, recorded), finish cancelled or overdue requests, drop finished
   rows from the batch, and admit waiting requests while the KV budget allows.
2. run: one forward over every RUNNING row's pending tokens (decode tokens, prompts of newcomers
   and evidence splices mixed, see ``runner_hf``); parked rows feed nothing.
3. postprocess: logits processors (caller's first, then hop budget / no-stop-in-query / query
   cap), sampling, marker matching, stop checks. A row that completed a marker is parked and its
   query handed to the worker, which batches every query waiting for it into one search.

``sync_retrieval`` searches inside the step instead (the decode path waits), for comparison.
``reprefill`` (reference mode, implies sync retrieval) does what string-based RIG systems do: a row
with evidence to add drops its cache and prefills its whole token list again (no prefix reuse),
while the other rows decode on.

Errors never stop generation: a failed or timed-out search, an empty or garbled marker, a full
context: each is recorded in the row's trace, and the row continues with a no-evidence block or
finishes with a reason.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from ..citations import CitationProcessor, trace_docs
from ..evidence import EvidenceFormatter, number_hits
from ..gate import GateProcessor, GateSettings
from ..kernels import rope_of
from ..kernels.chunk_kv import ChunkKVStore
from ..logits import marker_processors
from ..markers import MarkerMatcher, MarkerSpec, MarkerVocab
from ..memory import EvidenceMemory, Reuse, find_reuse
from ..retrieval.base import Hit, Retriever
from ..trace import RetrievalStep, RetrievedDoc
from .retrieval_worker import RetrievalResult, RetrievalWorker
from .runner_hf import HFModelRunner
from .sequence import Sequence, SequenceStatus

WAITING, RUNNING, RETRIEVING, FINISHED = (SequenceStatus.WAITING, SequenceStatus.RUNNING,
                                          SequenceStatus.RETRIEVING, SequenceStatus.FINISHED)


@dataclass(frozen=True, slots=True)
class EngineOptions:
    max_iterations: int = 3
    max_query_tokens: int = 48
    evidence_token_budget: int = 384
    marker_style: str = "special_token"
    top_k: int = 3
    retrieval_timeout_s: float = 10.0
    retrieval_retries: int = 1
    max_hung_searches: int = 4
    """Abandoned searches (past ``retrieval_timeout_s``) that may still run before retrieval is
    degraded: then hops get a no-evidence block at once instead of a wait."""
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    deadline_s: float | None = None
    newline_ends_query: bool = True
    retrieve_first: bool = False
    max_batch_size: int = 64
    kv_budget_tokens: int | None = None
    """Token slots the KV cache may hold (rows x columns); None: unlimited."""
    sync_retrieval: bool = False
    reprefill: bool = False
    """Reference mode: re-prefill the whole batch after every hop instead of splicing."""
    citations: bool = False
    """Constrain ``[n]`` citations to documents the row's evidence showed (``citations.py``)."""
    gate: GateSettings | None = None
    """Retrieval gating (``gate.py``); None: every marker the model writes is served."""
    append_format: str = "full"
    """``summary``: when a hop's evidence arrives, the earlier blocks leave the cache (the model's
    own text after each block stays, as its summary of it), so at most one block is kept."""
    zero_prefill: bool = False
    """Splice evidence from per-piece KV computed once, alone (``kernels/chunk_kv.py``), recomputing
    only the block's tail: an approximation of the exact splice (off by default)."""
    zero_prefill_recompute: float = 0.1
    """Share of each block's tokens (at least its last one) recomputed with full attention."""
    zero_prefill_select: str = "tail"
    """Which tokens are recomputed: ``tail``, the block's last ones; ``deviation``, its last one and
    those whose layer-1 values, computed in context, differ most from the reused ones (CacheBlend;
    costs a two-layer pass over the block)."""
    chunk_store_bytes: int = 256 << 20
    """Bytes of piece KV kept on the model's device, least recently used dropped first."""
    chunk_store_host_bytes: int = 0
    """Bytes of piece KV kept in host memory once the device's share is full: a hit there costs a
    copy to the device instead of a forward."""
    reuse_similarity: float | None = None
    """A hop whose query is at least this similar to an earlier one (this answer's, or the
    conversation memory's) references that query's documents instead of searching again."""


class RigEngine:
    def __init__(self, model, tokenizer, retriever: Retriever | None, options: EngineOptions = EngineOptions(),
                 extra_processors=(), vocab: MarkerVocab | None = None, runner=None):
        """``model``: a HuggingFace causal LM, run in process; or None with a ``runner`` that stands
        for a model elsewhere (``runner_remote.RemoteRunner``: a completion server)."""
        self.model, self.tokenizer, self.retriever, self.opts = model, tokenizer, retriever, options
        self.vocab = vocab or MarkerVocab(tokenizer, MarkerSpec.from_style(options.marker_style))
        self.formatter = EvidenceFormatter(tokenizer, options.evidence_token_budget)
        self.stop_ids = _stop_ids(model, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        if runner is None and model is None:
            raise ValueError("RigEngine needs a model or a runner")
        self.runner = runner if runner is not None else HFModelRunner(model, pad, options.kv_budget_tokens)
        if options.append_format not in ("full", "summary"):
            raise ValueError(f"append_format must be full or summary, got {options.append_format!r}")
        self.chunks = None
        if options.zero_prefill:
            if model is None or not isinstance(self.runner, HFModelRunner):
                raise ValueError("zero_prefill copies precomputed KV into the cache: "
                                 "it needs the in-process (hf) backend")
            if not 0.0 <= options.zero_prefill_recompute <= 1.0:
                raise ValueError(f"zero_prefill_recompute must be in [0, 1], got {options.zero_prefill_recompute}")
            if options.zero_prefill_select not in ("tail", "deviation"):
                raise ValueError(f"zero_prefill_select must be tail or deviation, got {options.zero_prefill_select!r}")
            self.chunks = ChunkKVStore(model, options.chunk_store_bytes, host_bytes=options.chunk_store_host_bytes)
        if options.append_format == "summary" and not hasattr(self.runner, "evict"):
            raise ValueError(f"append_format: summary drops evidence from the KV cache, which "
                             f"{type(self.runner).__name__} cannot do; use the in-process (hf) backend")
        if model is not None and not options.reprefill and (options.zero_prefill or options.append_format == "summary"):
            try:  # both move cached keys to other positions: refused now, not at the first hop
                rope_of(model)
            except ValueError as e:
                what = "zero_prefill" if options.zero_prefill else "append_format: summary"
                raise ValueError(f"{what} re-rotates cached keys: {e}") from None
        self.runner.reset(0)
        self.processors = [
            *extra_processors,
            *([GateProcessor(self.vocab, options.gate, options.max_iterations, _guarded(getattr(retriever, "knows", None)))]
              if options.gate is not None else []),
            *marker_processors(self.vocab, options.max_iterations, options.max_query_tokens,
                               self.stop_ids, options.newline_ends_query, options.retrieve_first),
        ]
        if options.citations:  # last: no other processor can re-open a banned citation
            self.processors.append(CitationProcessor(self.vocab))
        self.worker = RetrievalWorker(retriever, options.top_k, options.retrieval_retries,
                                      options.retrieval_timeout_s, options.max_hung_searches)
        self.sync = options.sync_retrieval or options.reprefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # row i of the runner's batch
        self.num_steps = 0
        self._lock = threading.Lock()

    # -- requests -----------------------------------------------------------------------------------

    def new_sequence(self, prompt_ids: list[int], seq_id: int = 0, question: str = "", *,
                     max_new_tokens: int | None = None, max_iterations: int | None = None,
                     top_k: int | None = None, temperature: float | None = None, top_p: float | None = None,
                     seed: int | None = None, memory: EvidenceMemory | None = None) -> Sequence:
        """A request's sequence; the keyword arguments override the engine's options for it alone."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        limit = self.runner.context_limit
        if len(prompt_ids) >= limit:
            raise ValueError(f"prompt is {len(prompt_ids)} tokens; the model's context holds {limit}")
        for name, value in (("max_new_tokens", max_new_tokens), ("top_k", top_k)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if max_iterations is not None and max_iterations < 0:
            raise ValueError(f"max_iterations must be at least 0, got {max_iterations}")
        temp = self.opts.temperature if temperature is None else temperature
        gen = None
        if temp > 0:
            # a request's own seed reproduces it; the engine's seed is spread over sequences
            gen = torch.Generator().manual_seed(self.opts.seed + seq_id if seed is None else seed)
        seq = Sequence(seq_id, list(prompt_ids), MarkerMatcher(self.vocab),
                       self.opts.max_new_tokens if max_new_tokens is None else max_new_tokens, gen,
                       max_iterations=max_iterations, top_k=top_k, temperature=temperature, top_p=top_p,
                       memory=memory)
        seq.trace.question = question
        if memory is not None:
            seq.trace.memory_docs = list(memory.in_prompt())
        budget = self.opts.kv_budget_tokens
        if budget is not None and self._worst_case(seq) > budget:
            raise ValueError(f"request needs up to {self._worst_case(seq)} KV tokens "
                             f"(prompt {len(prompt_ids)}, generation and evidence); the KV budget is {budget}")
        return seq

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; it joins the batch at a coming step (thread-safe). Its ``seq_id``
        names it (``cancel``, scripted processors, sampling seeds): no other unfinished sequence of
        this engine may have it."""
        with self._lock:
            clash = next((x for x in (*self.waiting, *self.running) if x.seq_id == seq.seq_id and not x.is_finished),
                         None)
            if clash is not None:
                raise ValueError(f"seq_id {seq.seq_id} is already in this engine" +
                                 (" (the same sequence twice)" if clash is seq else "") +
                                 ": give every sequence its own id")
            seq.arrival = time.perf_counter()
            if self.opts.deadline_s is not None:
                seq.deadline_at = seq.arrival + self.opts.deadline_s
            seq.status = WAITING
            self.waiting.append(seq)

    def cancel(self, seq_id: int) -> bool:
        """Ask for a sequence to stop; it leaves the batch, and frees its cache, at the next step."""
        with self._lock:
            for s in (*self.waiting, *self.running):
                if s.seq_id == seq_id and not s.is_finished:
                    s.cancelled = True
                    return True
        return False

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(self, seqs: list[Sequence]) -> list[Sequence]:
        """Run these sequences to completion (admitted together, as one batch where they fit). A
        step that fails for the whole batch (the model's forward) raises, leaving the engine
        empty and ready for the next call."""
        for s in seqs:
            self.add(s)
        try:
            while self.has_unfinished:
                self.step()
        except Exception as e:
            self.abort_all(e)
            raise
        return seqs

    def abort_all(self, error: Exception) -> list[Sequence]:
        """Finish every queued and running sequence with reason ``error`` (recorded in its trace)
        and empty the batch: what a caller does when a step failed for the whole batch."""
        with self._lock:
            seqs, self.waiting = [*self.waiting, *self.running], deque()
        self.running = []
        now = time.perf_counter()
        for s in seqs:
            if not s.is_finished:
                s.trace.marker_errors.append(f"engine error: {type(error).__name__}: {error}")
                self._finish(s, "error", now)
        self.runner.reset(0)
        return seqs

    def retrieval_health(self) -> dict:
        """The retrieval worker's state: ``status`` ok | degraded, ``reason``, hung searches..."""
        return self.worker.health()

    # -- the step -----------------------------------------------------------------------------------

    def step(self) -> None:
        now = time.perf_counter()
        self._collect(self.worker.poll(), now)
        self._expire(now)
        self._evict(now)
        self._admit(now)
        if self.opts.reprefill:
            self._drop_caches_of_spliced_rows()
        ready = [i for i, s in enumerate(self.running) if s.status is RUNNING and s.pending]
        if not ready:
            if self.running:  # every row is parked: wait for the worker instead of spinning
                self.worker.wait(0.05)
            return
        rows = [self.running[i] for i in ready]
        staged = self._assemble_staged(ready)  # its time goes to the splicing rows only
        t0 = time.perf_counter()
        spliced = [s.has_evidence_pending for s in rows]
        feed = [s.pending if s.status is RUNNING else [] for s in self.running]
        if staged:
            reselect = {i: self.running[i].staged_reselect for i in staged}
            logits = self.runner.step(feed, staged=staged, reselect=reselect)
        else:
            logits = self.runner.step(feed)
        for s in rows:
            s.pending.clear()
            s.staged_block, s.staged_reselect = None, 0
        tokens, forced = self._sample(rows, logits, ready)
        done = time.perf_counter()
        dt_ms = (done - t0) * 1e3
        parked = []
        row_info = getattr(self.runner, "row_info", None)  # a remote runner: what the server did
        for i, s, tok, was_forced, was_spliced in zip(ready, rows, tokens, forced, spliced):
            if s.is_finished:  # its processors failed
                continue
            try:
                info = row_info(i) if row_info is not None else None
                if was_spliced:
                    s.trace.splice_ms += dt_ms
                    s.trace.retrieval_steps[-1].splice_ms += dt_ms
                    if info is not None:
                        s.trace.retrieval_steps[-1].info["server"] = info
                elif s.num_generated:
                    s.trace.decode_ms += dt_ms
                else:
                    s.trace.ttft_ms = (done - s.arrival) * 1e3
                self._postprocess(s, tok, was_forced)
            except Exception as e:  # noqa: BLE001 - one row's bookkeeping fails that row alone
                self._fail_row(s, "postprocessing its token", e, done)
            if s.status is RETRIEVING:
                parked.append(s)
        self._park(parked, done)
        self.runner.compact()
        self.num_steps += 1

    def _assemble_staged(self, ready: list[int]) -> dict[int, tuple]:
        """Row -> staged KV of the zero-prefill blocks about to be spliced, assembled in one call:
        the pieces any of them lacks are computed together, in one forward. Each of those rows'
        hop waited for that call: its time (``kv_ms``) goes to each row's splice time. Per row, the
        trace says how many of its block's pieces the store held (``piece_hits``) and how many it
        had to compute (``piece_misses``, in the shared forward; a piece twice in the block counts once,
        and a document's cut text counts even when the forward computed it as the start of another
        row's whole text) and their tokens (``piece_tokens_computed``, leads not counted)."""
        rows = [i for i in ready if self.running[i].staged_block is not None]
        if not rows:
            return {}
        t0 = time.perf_counter()
        try:
            assembled = self.chunks.blocks_kv([self.running[i].staged_block for i in rows])
        except Exception as e:  # noqa: BLE001 - the blocks are fed whole instead: the exact splice
            for i in rows:
                s = self.running[i]
                s.staged_block, s.staged_reselect = None, 0
                s.trace.retrieval_steps[-1].info["zero_prefill"]["fallback"] = (
                    f"exact splice: assembling staged KV failed ({type(e).__name__}: {e})")
            return {}
        kv_ms = (time.perf_counter() - t0) * 1e3
        for i, block in zip(rows, assembled):
            s = self.running[i]
            s.trace.splice_ms += kv_ms
            step = s.trace.retrieval_steps[-1]
            step.splice_ms += kv_ms
            missed = block.computed
            step.info["zero_prefill"].update(piece_hits=len(block.pieces) - len(missed), piece_misses=len(missed),
                                             piece_tokens_computed=sum(len(ids) for _, ids in missed),
                                             blocks_assembled_together=len(rows), kv_ms=round(kv_ms, 3))
        return {i: (block.kv, block.shifts) for i, block in zip(rows, assembled)}

    # -- schedule -----------------------------------------------------------------------------------

    def _drop_caches_of_spliced_rows(self) -> None:
        """Reference mode: rows with evidence to add leave the cache and rejoin as new rows that
        prefill their whole token list (marker, evidence and all) from scratch."""
        moved = [s for s in self.running if s.status is RUNNING and s.has_evidence_pending]
        if not moved:
            return
        keep = [i for i, s in enumerate(self.running) if s not in moved]
        self.runner.select(keep)
        self.running = [self.running[i] for i in keep]
        for s, rest in zip(moved, self.runner.add_rows([s.kept_ids for s in moved], share_prefix=False)):
            s.pending = list(rest)
            self.running.append(s)

    def _worst_case(self, s: Sequence) -> int:
        hops = self.opts.max_iterations if s.max_iterations is None else s.max_iterations
        return len(s.prompt_ids) + s.max_new_tokens + hops * (self.opts.evidence_token_budget + 1)

    def _admit(self, now: float) -> None:
        budget, new = self.opts.kv_budget_tokens, []
        with self._lock:
            while self.waiting and len(self.running) + len(new) < self.opts.max_batch_size:
                s = self.waiting[0]
                if budget is not None:
                    rows = len(self.running) + len(new) + 1
                    widest = max(self._worst_case(x) for x in (*self.running, *new, s))
                    if rows * widest > budget and (self.running or new):
                        break  # queue it: the batch is full for this budget
                new.append(self.waiting.popleft())
        if not new:
            return
        for s, rest in zip(new, self.runner.add_rows([s.prompt_ids for s in new])):
            s.status, s.pending = RUNNING, list(rest)
            s.trace.queue_ms = (now - s.arrival) * 1e3
            self.running.append(s)

    def _expire(self, now: float) -> None:
        with self._lock:
            for s in list(self.waiting):
                if s.cancelled or (s.deadline_at is not None and now > s.deadline_at):
                    self.waiting.remove(s)
                    self._finish(s, "cancelled" if s.cancelled else "deadline", now)
        for s in self.running:
            if s.is_finished:
                continue
            if s.cancelled:
                self._finish(s, "cancelled", now)
            elif s.deadline_at is not None and now > s.deadline_at:
                self._finish(s, "deadline", now)
            elif s.status is RETRIEVING and now - s.parked_at > self.opts.retrieval_timeout_s:
                self._serve(s, [], f"retriever timed out after {self.opts.retrieval_timeout_s:g}s", now,
                             latency_ms=(now - s.parked_at) * 1e3)

    def _evict(self, now: float) -> None:
        keep = [i for i, s in enumerate(self.running) if not s.is_finished]
        if len(keep) != len(self.running):
            self.runner.select(keep)
            self.running = [self.running[i] for i in keep]

    def _finish(self, s: Sequence, reason: str, now: float, step: RetrievalStep | None = None) -> None:
        """End a sequence. One parked on a marker gets that hop recorded (``step``, or one saying
        why no evidence came), so every marker it completed has its ``RetrievalStep``."""
        if s.status is RETRIEVING:
            if step is None:
                step = RetrievalStep(s.matcher.num_markers, s.query or "",
                                     error=_UNSERVED.get(reason, f"{reason} at the marker; no retrieval"),
                                     position=len(s.token_ids))
                if s.parked_at:
                    step.latency_ms = (now - s.parked_at) * 1e3
            step.fallback = step.fallback or "no evidence: finished"
            s.trace.retrieval_steps.append(step)
        s.ticket = 0  # a search still in flight is dropped when it returns
        s.finish(reason)
        s.trace.total_ms = (now - s.arrival) * 1e3
        s.trace.marker_tokens = s.matcher.num_marker_tokens()

    def _fail_row(self, s: Sequence, what: str, error: Exception, now: float) -> None:
        """A failure handling one row ends that row (reason ``error``, recorded); its cache leaves
        the batch at the next step, the other rows go on."""
        s.trace.marker_errors.append(f"engine error while {what}: {type(error).__name__}: {error}")
        if not s.is_finished:
            self._finish(s, "error", now)

    # -- postprocess --------------------------------------------------------------------------------

    def _sample(self, rows: list[Sequence], all_logits: torch.Tensor, ready: list[int]) -> tuple[list[int], list[bool]]:
        """Sampled token per row, and whether a processor forced it (one finite logit left).
        Processors that fail on the batch run again row by row (from the same raw logits): a
        row they still fail on ends (reason ``error``), the others sample as they would have."""
        try:
            logits = self._process(rows, all_logits[ready])
        except Exception:  # noqa: BLE001 - find the row(s) it fails on
            parts = []
            for i, s in zip(ready, rows):
                try:
                    parts.append(self._process([s], all_logits[i : i + 1].clone()))
                except Exception as e:  # noqa: BLE001
                    self._fail_row(s, "applying logits processors", e, time.perf_counter())
                    parts.append(all_logits[i : i + 1])
            logits = torch.cat(parts)
        forced = (torch.isfinite(logits).sum(dim=-1) == 1).tolist()
        tokens = logits.argmax(dim=-1).tolist()
        for i, s in enumerate(rows):
            temp = self.opts.temperature if s.temperature is None else s.temperature
            if temp > 0 and not forced[i] and not s.is_finished:
                top_p = self.opts.top_p if s.top_p is None else s.top_p
                tokens[i] = _sample_row(logits[i], temp, top_p, s.generator)
        return tokens, forced

    def _process(self, rows: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        for p in self.processors:
            logits = p.apply(rows, logits)
        return logits

    def _postprocess(self, s: Sequence, tok: int, forced: bool) -> None:
        now = time.perf_counter()
        s.append([tok], sampled=not forced)
        s.num_generated += 1
        s.trace.generated_tokens += 1
        if tok in self.stop_ids:
            self._finish(s, "stop", now)
            return
        for ev in s.matcher.feed(tok):
            if ev.kind == "error":
                s.trace.marker_errors.append(ev.error)
            elif s.status is RUNNING:
                s.status, s.query = RETRIEVING, ev.query
            else:
                s.trace.marker_errors.append("a second marker in the same token was ignored")
        if s.num_generated >= s.max_new_tokens:
            self._finish(s, "length", now)
        elif s.num_kept >= self.runner.context_limit:
            self._finish(s, "context_full", now)
        elif s.deadline_at is not None and now > s.deadline_at:
            self._finish(s, "deadline", now)

    def _park(self, parked: list[Sequence], now: float) -> None:
        """Hand the parked rows' queries to the worker (an empty query gets no search)."""
        for s in parked:
            s.parked_at = now
            try:
                reuse = self._find_reuse(s)
                if reuse is not None:  # answered from documents already in context: no search
                    self._serve(s, [], None, now, reuse=reuse)
                elif s.query:
                    s.ticket = self.worker.submit(s.seq_id, s.query, s.top_k)
                else:
                    self._serve(s, [], "empty query", now)
            except Exception as e:  # noqa: BLE001 - this row's hop fails alone
                self._serve(s, [], f"search could not be queued: {type(e).__name__}: {e}", now)
        self.worker.flush()  # this step's queries, in one search call
        if self.sync:  # the decode path waits for this step's searches
            waiting = [s for s in parked if s.status is RETRIEVING]
            limit = now + self.opts.retrieval_timeout_s
            while any(s.status is RETRIEVING for s in waiting) and time.perf_counter() < limit:
                self.worker.wait(max(0.0, limit - time.perf_counter()))
                self._collect(self.worker.poll(), time.perf_counter())
            self._expire(time.perf_counter())

    def _find_reuse(self, s: Sequence) -> Reuse | None:
        if not s.query or self.opts.reuse_similarity is None:
            return None
        try:
            return find_reuse(s.query, s.memory, s.trace, self.opts.reuse_similarity,
                              hops_in_context=self.opts.append_format != "summary")
        except Exception as e:  # noqa: BLE001 - no reuse: the query is searched
            s.hop_info["reuse_error"] = f"{type(e).__name__}: {e}"
            return None

    def _collect(self, results: list[RetrievalResult], now: float) -> None:
        by_ticket = {s.ticket: s for s in self.running if s.status is RETRIEVING and s.ticket}
        for r in results:
            s = by_ticket.get(r.ticket)
            if s is not None:  # else: the sequence gave up on it (timeout, cancel, deadline)
                self._serve(s, r.hits, r.error, now, r.latency_ms, r.batch_size, r.attempts)

    def _serve(self, s: Sequence, hits: list[Hit], error: str | None, now: float, latency_ms: float = 0.0,
               batch_size: int = 0, attempts: int = 0, reuse: Reuse | None = None) -> None:
        """``_splice``, with its failures kept to the row: one that fails before changing anything
        (rendering, numbering) gets a no-evidence block with the failure recorded; a second
        failure, or one after the row's cache changed, finishes the row (reason ``error``)."""
        try:
            self._splice(s, hits, error, now, latency_ms, batch_size, attempts, reuse)
            return
        except _RowBroken as e:
            s.trace.marker_errors.append(f"engine error while splicing its evidence: {e.step.error}")
            self._finish(s, "error", now, e.step)
            return
        except Exception as e:  # noqa: BLE001
            why = f"evidence could not be rendered ({type(e).__name__}: {e})"
        try:
            self._splice(s, [], why if error is None else f"{error}; {why}", now, latency_ms, batch_size, attempts)
        except Exception as e:  # noqa: BLE001
            self._fail_row(s, "splicing a no-evidence block", e.__cause__ or e, now)

    def _splice(self, s: Sequence, hits: list[Hit], error: str | None, now: float, latency_ms: float = 0.0,
                batch_size: int = 0, attempts: int = 0, reuse: Reuse | None = None) -> None:
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
            self._finish(s, "context_full", now, step)
            return
        # the block renders hits in order, up to its budget
        step.docs = [RetrievedDoc(h.doc_id, h.title, h.score, h.source, n, text)
                     for h, n, text in zip(hits, numbers, block.shown)]
        if block.truncated:
            step.info["evidence_cut"] = True
        step.evidence_tokens = len(block.token_ids)
        if summary:
            try:
                self._drop_old_evidence(s, step)
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
                s.staged_block = (block.token_ids, block.segments, count, block.leads)
                s.staged_reselect = recompute - (n - count)
                step.info["zero_prefill"] = {"reused_tokens": n - recompute, "recomputed_tokens": recompute,
                                             "select": self.opts.zero_prefill_select}
        s.append(block.token_ids, sampled=False)
        s.status, s.query = RUNNING, None

    def _drop_old_evidence(self, s: Sequence, step: RetrievalStep) -> None:
        """Summary mode: the evidence blocks the row holds leave its cache (the reference mode only
        records it: the row's re-prefill leaves them out). Each span is recorded as it goes, so
        the row's bookkeeping matches its cache whatever fails."""
        row = self.running.index(s)
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

    def close(self) -> None:
        self.worker.close()
        if hasattr(self.runner, "close"):
            self.runner.close()


class _RowBroken(Exception):
    """A row's cache changed before its hop failed: the row cannot go on (``step`` records why)."""

    def __init__(self, step: RetrievalStep):
        super().__init__(step.error)
        self.step = step


_UNSERVED = {"length": "token limit reached at the marker; no retrieval",
             "context_full": "context full at the marker; no retrieval",
             "deadline": "deadline passed before the evidence came; no retrieval",
             "cancelled": "cancelled before the evidence came; no retrieval",
             "error": "the row failed before its evidence came; no retrieval"}


def _guarded(knows):
    """A retriever's ``knows(term)`` that cannot raise into a decode step (a failure: unknown)."""
    if knows is None:
        return None

    def safe(term: str) -> bool | None:
        try:
            answer = knows(term)
        except Exception:  # noqa: BLE001
            return None
        return answer if isinstance(answer, bool) else None

    return safe


def _sample_row(logits: torch.Tensor, temperature: float, top_p: float, generator) -> int:
    """One row's token: temperature, then nucleus (top-p) sampling with the row's own generator,
    so a row samples the same tokens whatever batch it is in."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator))


def _stop_ids(model, tokenizer) -> list[int]:
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids += eos if isinstance(eos, list) else [eos]
    if not ids:
        raise ValueError("the tokenizer defines no EOS token; cannot tell when an answer ends")
    return sorted(set(ids))
