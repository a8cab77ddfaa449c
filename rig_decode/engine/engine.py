"""The retrieval-interleaved decode loop with continuous batching.

Sequence states::

    WAITING --admitted--> RUNNING --marker--> RETRIEVING --evidence--> RUNNING --> FINISHED
       (queue, KV budget)          (parked; the other rows go on decoding)       (stop, length,
                                                                                  deadline, cancelled...)

``step()`` = schedule -> run -> postprocess, each part an object (or function) that returns what
it decided; none calls back into the engine:

1. schedule (``scheduler.py``): the hop handler serves the searches the worker has finished (each
   becomes that row's pending tokens: the marker-completing token plus the evidence block); the
   scheduler finishes cancelled or overdue requests and returns the parked rows whose search timed
   out (served with a no-evidence block, recorded), drops finished rows from the batch, admits
   waiting requests while the KV budget allows, and returns the rows to run.
2. run (``runner_hf.py``): one forward over every ready row's pending tokens (decode tokens, prompts
   of newcomers and evidence splices mixed); parked rows feed nothing. The runner writes the KV.
3. postprocess: the sampler (``sampling.py``) applies the logits processors (caller's first, then
   hop budget / no-stop-in-query / query cap) and samples; ``postprocess.py`` appends each token,
   matches markers and checks stops, and returns the rows that completed a marker; the hop handler
   (``hops.py``) hands their queries to the worker, which batches every query waiting for it into
   one search; their evidence is queued at a later step.

``sync_retrieval`` searches inside the step instead (the decode path waits), for comparison.
``reprefill`` (reference mode, implies sync retrieval) does what string-based RIG systems do: a row
with evidence to add drops its cache and prefills its whole token list again (no prefix reuse),
while the other rows decode on.

Errors never stop generation: a failed or timed-out search, an empty or garbled marker, a full
context: each is recorded in the row's trace, and the row continues with a no-evidence block or
finishes with a reason. Errors are data: a marker the model wrote wrong goes to
``trace.marker_errors``, a failure of the engine itself to ``trace.engine_errors`` (reason
``error``), a failed search to its hop's ``error``.
"""

from __future__ import annotations

import dataclasses
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
from ..textstream import TextDeltas
from .hops import HopHandler
from .options import EngineOptions
from .postprocess import postprocess, stop_ids
from .retrieval_worker import RetrievalWorker
from .runner_hf import HFModelRunner
from .sampling import Sampler
from .scheduler import Scheduler
from .sequence import Sequence


PARTIAL_WAIT_S = 0.25
"""The longest a partial step waits for a model server's tokens before the engine looks again at
its other work (a search past its timeout; results and new requests wake it at once)."""


class RigEngine:
    def __init__(self, model, tokenizer, retriever: Retriever | None, options: EngineOptions = EngineOptions(),
                 extra_processors=(), vocab: MarkerVocab | None = None, runner=None, eos_ids=None):
        """``model``: a HuggingFace causal LM, run in process; or None with a ``runner`` that stands
        for a model elsewhere (``runner_remote.RemoteRunner``: a completion server). ``eos_ids``: the
        tokens that end an answer (default: the model's and tokenizer's EOS)."""
        self.model, self.tokenizer, self.retriever, self.opts = model, tokenizer, retriever, options
        self.vocab = vocab or MarkerVocab(tokenizer, MarkerSpec.from_style(options.marker_style))
        self.stop_ids = sorted({int(t) for t in eos_ids}) if eos_ids else stop_ids(model, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        if runner is None and model is None:
            raise ValueError("RigEngine needs a model or a runner")
        self.runner = runner if runner is not None else HFModelRunner(
            model, pad, options.kv_budget_tokens, prefill_chunk=options.prefill_chunk_tokens,
            decode_step=options.decode_step)
        if hasattr(self.runner, "stop_at"):  # a streaming runner: where its streams stop
            self.runner.stop_at(self.vocab, self.stop_ids)
        rows = getattr(self.runner, "max_rows", None)  # a server with that many slots (llama-server)
        if rows and rows < options.max_batch_size:
            self.opts = options = dataclasses.replace(options, max_batch_size=rows)
        self.chunks = self._chunk_store(model, options)
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
            *([GateProcessor(self.vocab, options.gate, options.max_iterations,
                             _guarded(getattr(retriever, "knows", None)))]
              if options.gate is not None else []),
            *marker_processors(self.vocab, options.max_iterations, options.max_query_tokens,
                               self.stop_ids, options.newline_ends_query, options.retrieve_first),
        ]
        if options.citations:  # last: no other processor can re-open a banned citation
            self.processors.append(CitationProcessor(self.vocab))
        self.worker = RetrievalWorker(retriever, options.top_k, options.retrieval_retries,
                                      options.retrieval_timeout_s, options.max_hung_searches)
        if hasattr(self.runner, "wake"):  # a search's result ends a partial step's wait for tokens
            self.worker.on_result = self.runner.wake
        self.scheduler = Scheduler(self.runner, options)
        self.sampler = Sampler(self.processors, options)
        self.hops = HopHandler(self.worker, EvidenceFormatter(tokenizer, options.evidence_token_budget), self.runner,
                               options, self.chunks)
        self.num_steps = 0

    def _chunk_store(self, model, options: EngineOptions) -> ChunkKVStore | None:
        if not options.zero_prefill:
            return None
        if model is None or not isinstance(self.runner, HFModelRunner):
            raise ValueError("zero_prefill copies precomputed KV into the cache: it needs the in-process (hf) backend")
        return ChunkKVStore(model, options.chunk_store_bytes, host_bytes=options.chunk_store_host_bytes)

    @property
    def running(self) -> list[Sequence]:
        """The batch: ``running[i]`` is row ``i`` of the runner's cache."""
        return self.scheduler.running

    @property
    def waiting(self) -> deque[Sequence]:
        """Sequences queued for a place in the batch."""
        return self.scheduler.waiting

    @property
    def formatter(self) -> EvidenceFormatter:
        return self.hops.formatter

    # -- requests -----------------------------------------------------------------------------------

    def new_sequence(self, prompt_ids: list[int], seq_id: int = 0, question: str = "", *,
                     max_new_tokens: int | None = None, max_iterations: int | None = None,
                     top_k: int | None = None, temperature: float | None = None, top_p: float | None = None,
                     seed: int | None = None, memory: EvidenceMemory | None = None, stop: list[str] | None = None,
                     raw: bool = False, filters: dict | None = None) -> Sequence:
        """A request's sequence; the keyword arguments override the engine's options for it alone.
        ``stop``: strings that end the answer (not part of it); ``raw``: the answer is the whole
        completion as the model saw it (markers and evidence included) instead of the visible text;
        ``filters``: metadata filters of its searches, over the retriever's own."""
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
                       memory=memory, filters=filters or None,
                       answer=TextDeltas(self.vocab, self.stop_ids, raw=raw, stop=stop))
        seq.trace.question = question
        if memory is not None:
            seq.trace.memory_docs = list(memory.in_prompt())
        budget, need = self.opts.kv_budget_tokens, self.scheduler.worst_case(seq)
        if budget is not None and need > budget:
            raise ValueError(f"request needs up to {need} KV tokens "
                             f"(prompt {len(prompt_ids)}, generation and evidence); the KV budget is {budget}")
        return seq

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; it joins the batch at a coming step (thread-safe). Its ``seq_id``
        names it (``cancel``, scripted processors, sampling seeds): no other unfinished sequence of
        this engine may have it."""
        self.scheduler.add(seq)
        self._wake()

    def cancel(self, seq_id: int) -> bool:
        """Ask for a sequence to stop; it leaves the batch, and frees its cache, at the next step."""
        found = self.scheduler.cancel(seq_id)
        self._wake()
        return found

    def _wake(self) -> None:
        """A step waiting for a model server's tokens looks at the queue now."""
        wake = getattr(self.runner, "wake", None)
        if wake is not None:
            wake()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

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
        """Finish every queued and running sequence with reason ``error`` (an engine error in its
        trace) and empty the batch: what a caller does when a step failed for the whole batch."""
        now = time.perf_counter()
        seqs = self.scheduler.take_all()
        try:
            for s in seqs:
                if not s.is_finished:
                    s.fail("the step failed for the whole batch", error, now)
        finally:
            self.runner.reset(0)
        return seqs

    def weights_changed(self) -> None:
        """The model was trained since the last request (an RL rollout between optimiser steps): the
        KV the runner keeps across requests (the shared prompt prefix) was computed by the old weights
        and goes. Call it with nothing in flight."""
        if self.has_unfinished:
            raise RuntimeError("weights_changed with requests in flight")
        if self.chunks is not None:
            raise ValueError("zero_prefill keeps evidence KV computed by earlier weights: not for a model in training")
        if isinstance(self.runner, HFModelRunner):
            self.runner.reset(0, weights_changed=True)

    def retrieval_health(self) -> dict:
        """The retrieval worker's state: ``status`` ok | degraded, ``reason``, hung searches..."""
        return self.worker.health()

    # -- the step -----------------------------------------------------------------------------------

    def step(self) -> None:
        """One step: schedule -> run -> postprocess (the module docstring says what each does)."""
        ready = self._schedule(time.perf_counter())
        batch = self.scheduler.running
        if not ready:
            if batch:  # every row is parked: wait for the worker instead of spinning
                self.worker.wait(0.05)
            return
        staged = self.hops.assemble_staged({i: batch[i] for i in ready})  # its time goes to the splicing rows
        t0 = time.perf_counter()
        spliced = {i: batch[i].has_evidence_pending for i in ready}
        for i in ready:
            if batch[i].fed_at is None:
                batch[i].fed_at = t0
        logits, ready = self._run(ready, staged)
        if not ready:  # a model server's rows, none of whose tokens has come yet
            return
        rows = [batch[i] for i in ready]
        started = [s.fed_at for s in rows]
        for s in rows:
            s.fed_at = None
        picked = self.runner.take_picks() if hasattr(self.runner, "take_picks") else None
        sampled = self.sampler.sample(rows, logits, ready, time.perf_counter(), picked)
        parked = postprocess(rows, sampled, [spliced[i] for i in ready], started, self.stop_ids,
                             self.runner.context_limit, getattr(self.runner, "row_info", None), ready)
        now = time.perf_counter()
        if parked and hasattr(self.runner, "pause"):  # a remote row's stream stops while it searches
            gone = {id(s) for s in parked}
            self.runner.pause([i for i in ready if id(batch[i]) in gone])
        self.hops.park(batch, parked, now)
        if self.opts.waits_for_retrieval:  # the decode path waits for this step's searches
            self.hops.wait_for(batch, parked, now)
            self._expire(time.perf_counter())
        self.runner.compact()
        self.num_steps += 1

    def _schedule(self, now: float) -> list[int]:
        """Serve finished searches, end what must end, admit waiting requests; the rows to run."""
        self.hops.serve_results(self.scheduler.running, self.worker.poll(), now)
        self._expire(now)
        self.scheduler.drop_finished()
        self.scheduler.admit(now)
        if self.opts.reprefill:
            self.scheduler.move_spliced_rows()
        return self.scheduler.ready()

    def _expire(self, now: float) -> None:
        for s in self.scheduler.expire(now):
            self.hops.time_out(self.scheduler.running, s, now)

    def _run(self, ready: list[int], staged: dict[int, tuple]) -> tuple[torch.Tensor, list[int]]:
        """One forward over the ready rows' pending tokens (the runner writes their KV): the logits,
        and the rows they are for. Those are all of ``ready``, except on a runner that answers rows
        as their tokens come (``partial_steps``: a model server): there a row whose token has not
        come yet (its evidence being prefilled) keeps its pending tokens, which the runner already
        has, and is asked again at the next step, while the others go on."""
        batch, fed = self.scheduler.running, set(ready)
        feed = [s.pending if i in fed else [] for i, s in enumerate(batch)]
        answered = ready
        if staged:
            reselect = {i: batch[i].staged.reselect for i in staged}
            logits = self.runner.step(feed, staged=staged, reselect=reselect)
        else:
            kw = {}
            if getattr(self.runner, "takes_rules", False):  # a model server: its picks the rules allow
                kw["rules"] = [self.sampler.pick_rule(s) if i in fed else None for i, s in enumerate(batch)]
            if getattr(self.runner, "partial_steps", False):
                kw.update(partial=True, max_wait_s=PARTIAL_WAIT_S)
            logits = self.runner.step(feed, **kw)
            if kw.get("partial"):
                answered = self.runner.take_answered()
        take_errors = getattr(self.runner, "take_row_errors", None)  # a remote row whose request failed
        for i, error in (take_errors() if take_errors else {}).items():
            batch[i].fail("asking the model server", error, time.perf_counter())
        for i in answered:
            batch[i].pending.clear()
            batch[i].staged = None
        return logits, answered

    def close(self) -> None:
        self.worker.close()
        if hasattr(self.runner, "close"):
            self.runner.close()


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
