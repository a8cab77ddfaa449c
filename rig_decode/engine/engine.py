"""The retrieval-interleaved decode loop over a batch of sequences.

``step()`` is schedule -> run -> postprocess:

1. run: one forward over every running row's pending tokens (decode tokens and hop splices mixed,
   see ``runner_hf``); with ``reprefill=True`` a step that carries a splice instead rebuilds the
   whole cache from the full token lists, as string-based RIG systems do (the reference mode).
2. postprocess: logits processors (caller's first, then hop budget / no-stop-in-query / query cap),
   sampling, marker matching, stop checks.
3. retrieval: every row that completed a marker this step is RETRIEVING; their queries go to the
   retriever in ONE ``search_batch`` call, each row's hits become an evidence block, and the block
   is queued as that row's pending tokens behind the marker-completing token.

Retrieval here is synchronous within the step (the serving engine moves it off the decode path).
Errors never stop generation: a failed or timed-out search, an empty or garbled marker, a full
context: each is recorded in the row's trace, and the row continues with a no-evidence block or
finishes with a reason.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

from ..evidence import EvidenceFormatter
from ..logits import marker_processors
from ..markers import MarkerMatcher, MarkerSpec, MarkerVocab
from ..retrieval.base import Hit, Retriever
from ..trace import RetrievalStep, RetrievedDoc
from .runner_hf import HFModelRunner
from .sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class EngineOptions:
    max_iterations: int = 3
    max_query_tokens: int = 48
    evidence_token_budget: int = 384
    marker_style: str = "special_token"
    top_k: int = 3
    retrieval_timeout_s: float = 10.0
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    deadline_s: float | None = None
    newline_ends_query: bool = True
    retrieve_first: bool = False
    reprefill: bool = False
    """Reference mode: re-prefill the whole batch after every hop instead of splicing."""


class RigEngine:
    def __init__(self, model, tokenizer, retriever: Retriever | None, options: EngineOptions = EngineOptions(),
                 extra_processors=(), vocab: MarkerVocab | None = None):
        self.model, self.tokenizer, self.retriever, self.opts = model, tokenizer, retriever, options
        self.vocab = vocab or MarkerVocab(tokenizer, MarkerSpec.from_style(options.marker_style))
        self.formatter = EvidenceFormatter(tokenizer, options.evidence_token_budget)
        self.stop_ids = _stop_ids(model, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.runner = HFModelRunner(model, pad)
        self.processors = [
            *extra_processors,
            *marker_processors(self.vocab, options.max_iterations, options.max_query_tokens,
                               self.stop_ids, options.newline_ends_query, options.retrieve_first),
        ]
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="rig-retrieval")

    # ----------------------------------------------------------------------------------------------

    def new_sequence(self, prompt_ids: list[int], seq_id: int = 0, question: str = "") -> Sequence:
        if not prompt_ids:
            raise ValueError("empty prompt")
        limit = self.runner.context_limit
        if len(prompt_ids) >= limit:
            raise ValueError(f"prompt is {len(prompt_ids)} tokens; the model's context holds {limit}")
        gen = None
        if self.opts.temperature > 0:
            gen = torch.Generator().manual_seed(self.opts.seed + seq_id)
        seq = Sequence(seq_id, list(prompt_ids), MarkerMatcher(self.vocab), self.opts.max_new_tokens, gen)
        seq.trace.question = question
        return seq

    def generate(self, seqs: list[Sequence]) -> list[Sequence]:
        """Run these sequences to completion as one batch; returns them, finished."""
        t_start = time.perf_counter()
        active = list(seqs)
        for s in active:
            s.status = SequenceStatus.RUNNING
        needs_rebuild = True
        while active:
            t0 = time.perf_counter()
            if needs_rebuild:  # first step, or reference mode after a hop: prefill full token lists
                logits = self.runner.prefill([s.token_ids for s in active])
            else:
                logits = self.runner.step([s.pending for s in active])
            spliced = [len(s.pending) > 1 and s.num_generated > 0 for s in active]
            for s in active:
                s.pending.clear()
            tokens, forced = self._sample(active, logits)
            dt_ms = (time.perf_counter() - t0) * 1e3
            now_ms = (time.perf_counter() - t_start) * 1e3
            hops: list[Sequence] = []
            for s, tok, was_forced, was_splice in zip(active, tokens, forced, spliced):
                if was_splice:
                    s.trace.splice_ms += dt_ms
                    s.trace.retrieval_steps[-1].splice_ms = dt_ms
                elif s.num_generated:
                    s.trace.decode_ms += dt_ms
                if s.num_generated == 0:
                    s.trace.ttft_ms = now_ms
                self._postprocess(s, tok, was_forced, now_ms)
                if s.status is SequenceStatus.RETRIEVING:
                    hops.append(s)
            if hops:
                self._retrieve(hops)
            needs_rebuild = self.opts.reprefill and bool(hops)
            keep = [i for i, s in enumerate(active) if not s.is_finished]
            for s in active:
                if s.is_finished:
                    s.trace.total_ms = (time.perf_counter() - t_start) * 1e3
                    s.trace.marker_tokens = s.matcher.num_marker_tokens()
            active = [active[i] for i in keep]
            if active and not needs_rebuild:
                self.runner.select(keep)
        return seqs

    # ----------------------------------------------------------------------------------------------

    def _sample(self, rows: list[Sequence], logits: torch.Tensor) -> tuple[list[int], list[bool]]:
        """Sampled token per row, and whether a processor forced it (one finite logit left)."""
        for p in self.processors:
            logits = p.apply(rows, logits)
        forced = (torch.isfinite(logits).sum(dim=-1) == 1).tolist()
        if self.opts.temperature <= 0:
            return logits.argmax(dim=-1).tolist(), forced
        probs = torch.softmax(logits / self.opts.temperature, dim=-1)
        if self.opts.top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > self.opts.top_p
            probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        # One generator per sequence: a row samples the same tokens whatever batch it is in.
        return [int(torch.multinomial(probs[i], 1, generator=s.generator)) for i, s in enumerate(rows)], forced

    def _postprocess(self, s: Sequence, tok: int, forced: bool, now_ms: float) -> None:
        s.append([tok], sampled=not forced)
        s.num_generated += 1
        s.trace.generated_tokens += 1
        if tok in self.stop_ids:
            s.finish("stop")
            return
        for ev in s.matcher.feed(tok):
            if ev.kind == "error":
                s.trace.marker_errors.append(ev.error)
            elif s.status is SequenceStatus.RUNNING:
                s.status, s.query = SequenceStatus.RETRIEVING, ev.query
            else:
                s.trace.marker_errors.append("a second marker in the same token was ignored")
        if s.status is SequenceStatus.RETRIEVING and s.num_generated >= s.max_new_tokens:
            s.trace.retrieval_steps.append(RetrievalStep(
                s.matcher.num_markers, s.query, error="token limit reached at the marker; no retrieval"))
            s.finish("length")
        elif s.num_generated >= s.max_new_tokens:
            s.finish("length")
        elif len(s.token_ids) >= self.runner.context_limit:
            s.finish("context_full")
        elif self.opts.deadline_s is not None and now_ms > self.opts.deadline_s * 1e3:
            s.finish("deadline")

    def _retrieve(self, rows: list[Sequence]) -> None:
        """One batched search for every row that completed a marker, then queue the evidence."""
        searchable = [s for s in rows if s.query]
        results: dict[int, list[Hit]] = {}
        error, latency_ms = None, 0.0
        if searchable and self.retriever is None:
            error = "no retriever configured"
        elif searchable:
            t0 = time.perf_counter()
            future = self._pool.submit(self.retriever.search_batch, [s.query for s in searchable], self.opts.top_k)
            try:
                hits = future.result(timeout=self.opts.retrieval_timeout_s)
                if len(hits) != len(searchable):
                    raise RuntimeError(f"retriever returned {len(hits)} result lists for {len(searchable)} queries")
                results = {s.seq_id: h for s, h in zip(searchable, hits)}
            except FutureTimeout:
                error = f"retriever timed out after {self.opts.retrieval_timeout_s:g}s"
            except Exception as e:  # noqa: BLE001 - any retriever failure becomes a recorded, empty hop
                error = f"retriever failed: {type(e).__name__}: {e}"
            latency_ms = (time.perf_counter() - t0) * 1e3
        for s in rows:
            hits = results.get(s.seq_id, [])
            step = RetrievalStep(s.matcher.num_markers, s.query, latency_ms=latency_ms,
                                 batch_size=len(searchable), position=len(s.token_ids))
            step.error = error if s.query else "empty query"
            step.info = dict(getattr(hits, "info", {}))
            step.fallback = step.info.get("fallback")
            if step.error or step.info.get("empty"):
                step.fallback = "no-evidence block" if step.error else f"{step.fallback}; no-evidence block"
            s.trace.retrieval_steps.append(step)
            s.trace.retrieval_ms += latency_ms
            room = self.runner.context_limit - len(s.token_ids) - 1
            try:
                block = self.formatter.render_block(hits, step.round, budget=room)
            except ValueError:
                step.error = "context full: no room for evidence"
                s.finish("context_full")
                continue
            step.docs = [RetrievedDoc(h.doc_id, h.title, h.score, h.source) for h in hits
                         if h.doc_id in block.doc_ids]
            step.evidence_tokens = len(block.token_ids)
            s.trace.evidence_tokens += len(block.token_ids)
            s.append(block.token_ids, sampled=False)
            s.status, s.query = SequenceStatus.RUNNING, None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _stop_ids(model, tokenizer) -> list[int]:
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids += eos if isinstance(eos, list) else [eos]
    if not ids:
        raise ValueError("the tokenizer defines no EOS token; cannot tell when an answer ends")
    return sorted(set(ids))
