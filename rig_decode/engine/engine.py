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
3. postprocess (``postprocess.py``): logits processors (caller's first, then hop budget / no-stop-in-query / query
   cap), sampling, marker matching, stop checks. A row that completed a marker is parked and its
   query handed to the worker, which batches every query waiting for it into one search; its
   evidence is spliced at a later step (``hops.py``).

``sync_retrieval`` searches inside the step instead (the decode path waits), for comparison.
``reprefill`` (reference mode, implies sync retrieval) does what string-based RIG systems do: a row
with evidence to add drops its cache and prefills its whole token list again (no prefix reuse),
while the other rows decode on.

Errors never stop generation: a failed or timed-out search, an empty or garbled marker, a full
context: each is recorded in the row's trace, and the row continues with a no-evidence block or
finishes with a reason.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch

from ..citations import CitationProcessor
from ..evidence import EvidenceFormatter
from ..gate import GateProcessor
from ..kernels import rope_of
from ..kernels.chunk_kv import ChunkKVStore
from ..logits import marker_processors
from ..markers import MarkerMatcher, MarkerSpec, MarkerVocab
from ..memory import EvidenceMemory
from ..retrieval.base import Retriever
from ..trace import RetrievalStep
from .hops import HopHandling
from .options import EngineOptions
from .postprocess import Postprocess, stop_ids
from .retrieval_worker import RetrievalWorker
from .runner_hf import HFModelRunner
from .sequence import Sequence, SequenceStatus

WAITING, RUNNING, RETRIEVING = SequenceStatus.WAITING, SequenceStatus.RUNNING, SequenceStatus.RETRIEVING


class RigEngine(HopHandling, Postprocess):
    def __init__(self, model, tokenizer, retriever: Retriever | None, options: EngineOptions = EngineOptions(),
                 extra_processors=(), vocab: MarkerVocab | None = None, runner=None):
        """``model``: a HuggingFace causal LM, run in process; or None with a ``runner`` that stands
        for a model elsewhere (``runner_remote.RemoteRunner``: a completion server)."""
        self.model, self.tokenizer, self.retriever, self.opts = model, tokenizer, retriever, options
        self.vocab = vocab or MarkerVocab(tokenizer, MarkerSpec.from_style(options.marker_style))
        self.formatter = EvidenceFormatter(tokenizer, options.evidence_token_budget)
        self.stop_ids = stop_ids(model, tokenizer)
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
        """One step: schedule -> run -> postprocess (the module docstring says what each does)."""
        ready = self._schedule(time.perf_counter())
        if not ready:
            if self.running:  # every row is parked: wait for the worker instead of spinning
                self.worker.wait(0.05)
            return
        rows = [self.running[i] for i in ready]
        staged = self._assemble_staged(ready)  # its time goes to the splicing rows only
        t0 = time.perf_counter()
        spliced = [s.has_evidence_pending for s in rows]
        tokens, forced = self._run(ready, staged)
        self._postprocess_step(ready, tokens, forced, spliced, t0)
        self.runner.compact()
        self.num_steps += 1

    def _schedule(self, now: float) -> list[int]:
        """Serve finished searches, end what must end, admit waiting requests; the rows to run."""
        self._collect(self.worker.poll(), now)
        self._expire(now)
        self._evict(now)
        self._admit(now)
        if self.opts.reprefill:
            self._drop_caches_of_spliced_rows()
        return [i for i, s in enumerate(self.running) if s.status is RUNNING and s.pending]

    def _run(self, ready: list[int], staged: dict[int, tuple]) -> tuple[list[int], list[bool]]:
        """One forward over the ready rows' pending tokens, then their sampled tokens."""
        rows = [self.running[i] for i in ready]
        feed = [s.pending if s.status is RUNNING else [] for s in self.running]
        if staged:
            reselect = {i: self.running[i].staged_reselect for i in staged}
            logits = self.runner.step(feed, staged=staged, reselect=reselect)
        else:
            logits = self.runner.step(feed)
        for s in rows:
            s.pending.clear()
            s.staged_block, s.staged_reselect = None, 0
        return self._sample(rows, logits, ready)

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

    def close(self) -> None:
        self.worker.close()
        if hasattr(self.runner, "close"):
            self.runner.close()


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
