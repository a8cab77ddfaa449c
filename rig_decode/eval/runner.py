"""``rig eval``: several methods over one dataset in one run, with the same model and retriever.

Methods:
  none           no retrieval; a plain "answer briefly" instruction
  rag            retrieve once with the question, evidence in the prompt, then answer
  rig            this project: the model retrieves when it asks, evidence spliced into the cache
  rig-reprefill  the same decisions, but every hop re-prefills the whole batch (string-based RIG)
  rig-summary    rig with ``append_format: summary``: a new hop's evidence evicts the earlier blocks
                 from the cache (the model's own text after them stays)
  rig-zero-prefill  rig with zero-prefill evidence: per-piece KV computed alone and reused, only
                 each block's tail recomputed (``kernels/chunk_kv.py``)
  rig-zero-prefill-deviation  the same, recomputing the tokens whose KV deviates most instead of
                 the tail (CacheBlend's selection; ``engine.zero_prefill.select: deviation``)

The rig methods run per ``max_iterations`` value; ``none`` and ``rag`` once. All
questions are queued at once and the engine keeps ``batch_size`` of them decoding (continuous
batching). A row computes the same tokens in any batch, so with greedy decoding ``rig`` and
``rig-reprefill`` give identical answers and only their cost differs. Latency is measured from a
question's admission to the batch to its last token.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

from tqdm.auto import tqdm

from ..engine.engine import RigEngine
from ..evidence import EvidenceFormatter
from ..markers import MarkerSpec
from ..prompt import build_prompt
from ..session import engine_options
from ..trace import RetrievalStep, RetrievedDoc, Trace
from . import metrics as M
from .datasets import EvalExample

METHODS = ("none", "rag", "rig", "rig-reprefill", "rig-summary", "rig-zero-prefill", "rig-zero-prefill-deviation")
VARIANTS = {"rig-reprefill": dict(reprefill=True), "rig-summary": dict(append_format="summary"),
            "rig-zero-prefill": dict(zero_prefill=True, zero_prefill_select="tail"),
            "rig-zero-prefill-deviation": dict(zero_prefill=True, zero_prefill_select="deviation")}
"""What each rig variant changes in the engine's options."""
APPROXIMATIONS = tuple(m for m in VARIANTS if m != "rig-reprefill")
"""The variants that approximate ``rig`` (``rig-reprefill`` computes the same tokens, only slower)."""
PLAIN_SYSTEM = "Answer the question in one short sentence."
RAG_SYSTEM = "Answer the question in one short sentence, using the evidence given with it."


@dataclass(frozen=True, slots=True)
class RunKey:
    method: str
    max_iterations: int | None

    @property
    def label(self) -> str:
        return self.method if self.max_iterations is None else f"{self.method}@{self.max_iterations}"


def plan(methods: list[str], max_iterations: list[int], reference_iterations: list[int] | None = None) -> list[RunKey]:
    """Run keys in order. ``reference_iterations`` limits ``rig-reprefill`` (same answers as ``rig``
    by construction, only slower) to some hop budgets; None runs it at every one."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if reference_iterations and not set(reference_iterations) <= set(max_iterations):
        raise ValueError("--reference-iterations must be a subset of --max-iterations")
    keys = []
    for m in methods:
        if m in ("none", "rag"):
            keys.append(RunKey(m, None))
        elif m == "rig-reprefill" and reference_iterations:
            keys += [RunKey(m, k) for k in reference_iterations]
        else:
            keys += [RunKey(m, k) for k in max_iterations]
    return keys


class EvalRunner:
    def __init__(self, config, model, tokenizer, retriever, batch_size: int = 8, progress: bool = True):
        self.config, self.model, self.tokenizer, self.retriever = config, model, tokenizer, retriever
        self.batch_size, self.progress = batch_size, progress
        self.spec = MarkerSpec.from_style(config.rig.marker_style)
        self.system = config.system_prompt()
        self.formatter = EvidenceFormatter(tokenizer, config.rig.evidence_token_budget)
        # Document texts, to judge hops by answer containment where a dataset has no gold doc ids.
        self.doc_texts: dict[str, str] = {}
        for chunk in getattr(retriever, "docs", []):
            self.doc_texts[chunk.doc_id] = self.doc_texts.get(chunk.doc_id, "") + " " + chunk.text

    def run(self, examples: list[EvalExample], keys: list[RunKey]) -> dict[RunKey, dict]:
        """Per run key: {"records": [...per question...], "wall_s": float}."""
        return {key: self._run_one(examples, key) for key in keys}

    # ----------------------------------------------------------------------------------------------

    def _engine(self, key: RunKey) -> RigEngine:
        iters = key.max_iterations if key.max_iterations is not None else 0
        opts = engine_options(self.config, self.model, max_iterations=iters, max_batch_size=self.batch_size,
                              **VARIANTS.get(key.method, {}))
        return RigEngine(self.model, self.tokenizer, self.retriever, opts)

    def _prompt(self, key: RunKey, ex: EvalExample, rag_block: str | None) -> list[int]:
        if key.method == "none":
            return build_prompt(self.tokenizer, ex.question, self.spec, PLAIN_SYSTEM)
        if key.method == "rag":
            content = f"Evidence:{rag_block}\nQuestion: {ex.question}"
            return build_prompt(self.tokenizer, [{"role": "system", "content": RAG_SYSTEM},
                                                 {"role": "user", "content": content}], self.spec)
        return build_prompt(self.tokenizer, ex.question, self.spec, self.system)

    def _run_one(self, examples: list[EvalExample], key: RunKey) -> dict:
        """All questions go to the engine at once; it keeps ``batch_size`` of them in the batch
        (continuous batching: a finished row's place goes to the next question)."""
        engine = self._engine(key)
        t_run = time.perf_counter()
        rag_steps, blocks = [None] * len(examples), [None] * len(examples)
        if key.method == "rag":
            for start in range(0, len(examples), self.batch_size):
                chunk = examples[start : start + self.batch_size]
                rag_steps[start : start + len(chunk)], blocks[start : start + len(chunk)] = self._rag_retrieve(chunk)
        seqs = [engine.new_sequence(self._prompt(key, ex, blk), seq_id=i, question=ex.question)
                for i, (ex, blk) in enumerate(zip(examples, blocks))]
        for seq, rag_step in zip(seqs, rag_steps):
            if rag_step is not None:  # in the trace before the answer ends: its citations are checked against it
                seq.trace.retrieval_steps.append(rag_step)
        for s in seqs:
            engine.add(s)
        bar = tqdm(total=len(examples), desc=f"{key.label:>16}", disable=not self.progress, unit="q")
        done = 0
        while engine.has_unfinished:
            engine.step()
            finished = sum(s.is_finished for s in seqs)
            bar.update(finished - done)
            done = finished
        bar.close()
        engine.close()
        records = []
        for ex, seq, rag_step in zip(examples, seqs, rag_steps):
            if rag_step is not None:
                seq.trace.retrieval_ms += rag_step.latency_ms
                seq.trace.total_ms += rag_step.latency_ms
                seq.trace.evidence_tokens = rag_step.evidence_tokens
            records.append(self._record(key, ex, seq.answer_text.strip(), seq.trace))
        return {"records": records, "wall_s": time.perf_counter() - t_run}

    def _rag_retrieve(self, batch: list[EvalExample]):
        t0 = time.perf_counter()
        hits = self.retriever.search_batch([ex.question for ex in batch], self.config.retriever.top_k)
        ms = (time.perf_counter() - t0) * 1e3
        steps, blocks = [], []
        for ex, h in zip(batch, hits):
            block = self.formatter.render_block(h, 1)
            docs = [RetrievedDoc(x.doc_id, x.title, x.score, x.source, n, text)  # numbered as the block shows them
                    for n, (x, text) in enumerate(zip(h, block.shown), 1)]
            steps.append(RetrievalStep(1, ex.question, docs,
                                       latency_ms=ms, evidence_tokens=len(block.token_ids), batch_size=len(batch)))
            blocks.append(block.text)
        return steps, blocks

    def _record(self, key: RunKey, ex: EvalExample, prediction: str, trace: Trace) -> dict:
        steps = trace.retrieval_steps
        relevant = [M.hop_is_relevant([d.id for d in s.docs], [self.doc_texts.get(d.id, "") for d in s.docs],
                                      ex.supporting_docs, ex.answers) for s in steps if s.docs or not s.error]
        retrieved = {d.id for s in steps for d in s.docs}
        markers_ok = sum(1 for s in steps if s.error != "empty query") if key.method.startswith("rig") else 0
        markers_bad = (len(trace.marker_errors) + sum(1 for s in steps if s.error == "empty query")
                       if key.method.startswith("rig") else 0)
        answer_tokens = max(1, trace.generated_tokens - trace.marker_tokens)
        return {
            "id": ex.id, "method": key.method, "max_iterations": key.max_iterations,
            "question": ex.question, "answers": ex.answers, "prediction": prediction,
            "gold_hops": ex.hops, "needs_retrieval": ex.needs_retrieval,
            "em": M.exact_match(prediction, ex.answers), "f1": M.f1_score(prediction, ex.answers),
            "accuracy": M.contains_answer(prediction, ex.answers),
            "hops": len(steps), "relevant_hops": sum(relevant), "judged_hops": len(relevant),
            "support_recall": (len(retrieved & set(ex.supporting_docs)) / len(ex.supporting_docs)
                               if ex.supporting_docs else None),
            "markers_valid": markers_ok, "markers_invalid": markers_bad,
            "engine_errors": len(trace.engine_errors),
            "token_overhead": (trace.marker_tokens + trace.evidence_tokens) / answer_tokens,
            "total_tokens": trace.prompt_tokens + trace.generated_tokens
                            + (trace.evidence_tokens if key.method != "rag" else 0),
            "evidence_kept": trace.evidence_tokens - trace.evicted_tokens,
            "splice_ms": trace.splice_ms,
            "latency_ms": trace.total_ms - trace.queue_ms,  # in the batch, not waiting for a place
            "source_claim_without_hop": bool(not steps and M.claims_sources(prediction)),
            "trace": trace.to_dict(),
        }


def aggregate(records: list[dict], wall_s: float) -> dict:
    n = len(records)
    judged = sum(r["judged_hops"] for r in records)
    recalls = [r["support_recall"] for r in records if r["support_recall"] is not None]
    no_need = [r for r in records if r["needs_retrieval"] is False]
    markers = sum(r["markers_valid"] + r["markers_invalid"] for r in records)
    lat = [r["latency_ms"] for r in records]
    num_hops = sum(r["hops"] for r in records)
    by_hops: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if r["gold_hops"] is not None:
            by_hops[str(r["gold_hops"])].append(r)
    return {
        "n": n,
        "exact_match": M.mean([r["em"] for r in records]),
        "f1": M.mean([r["f1"] for r in records]),
        "accuracy": M.mean([r["accuracy"] for r in records]),
        "retrieval_precision": sum(r["relevant_hops"] for r in records) / judged if judged else None,
        "support_recall": M.mean(recalls),
        "hops_per_question": M.mean([r["hops"] for r in records]),
        "unnecessary_retrieval_rate": M.mean([float(r["hops"] > 0) for r in no_need]),
        "marker_validity": sum(r["markers_valid"] for r in records) / markers if markers else None,
        "engine_error_rate": M.mean([float(r.get("engine_errors", 0) > 0) for r in records]),
        "token_overhead": M.mean([r["token_overhead"] for r in records]),
        "total_tokens_per_question": M.mean([r["total_tokens"] for r in records]),
        "evidence_kept_per_question": M.mean([r["evidence_kept"] for r in records]),
        "splice_ms_per_hop": sum(r["splice_ms"] for r in records) / num_hops if num_hops else None,
        "latency_p50_ms": M.percentile(lat, 50),
        "latency_p95_ms": M.percentile(lat, 95),
        "wall_s": wall_s,
        "source_claims_without_hop": M.mean([float(r["source_claim_without_hop"]) for r in records]),
        "accuracy_by_hops": {k: M.mean([r["accuracy"] for r in v]) for k, v in sorted(by_hops.items())},
        "exact_match_by_hops": {k: M.mean([r["em"] for r in v]) for k, v in sorted(by_hops.items())},
        "questions_by_hops": {k: len(v) for k, v in sorted(by_hops.items())},
    }
