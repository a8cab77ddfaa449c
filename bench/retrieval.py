"""Retrieval quality and batched latency on the shared HotpotQA dev subset.

All context paragraphs of the subset form one corpus (one chunk per paragraph); each question is a
query, and its supporting paragraphs (by title) are the gold set. For each method: recall@k of the
gold paragraphs (k = 2, 5, 10, averaged over questions; query typo correction on, and off in the
"no typo fix" rows; "hybrid + rerank": the default reranker, which ships with the package, over the
hybrid's top 20), then milliseconds per query for batches of 1, 8 and 32 queries (one
``search_batch`` call per batch, median over the whole question set).

    python bench/retrieval.py [--dataset ../shared/data/hotpotqa_dev_100.jsonl]
                              [--cross-encoder DIR]  # also the hybrid's top 20 reranked by it
                              [--reranker-dir DIR]   # likewise a flashrank model in DIR

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rig_decode.config import RerankerConfig, RetrieverConfig
from rig_decode.eval.datasets import load_dataset
from rig_decode.retrieval.factory import build_retriever

from harness import Table, emit  # bench/ is on sys.path when run as a script

KS = (2, 5, 10)
BATCHES = (1, 8, 32)
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "hotpotqa_dev_100.jsonl"


def methods(cross_encoder: str | None, reranker_dir: str | None) -> dict[str, RetrieverConfig]:
    base = dict(score_threshold=-1.0, candidates=20, reranker=RerankerConfig(type="none"))
    # a reranker over the hybrid's top 20 (an unbounded budget: this measures quality)
    rerank = dict(candidates=20, budget_ms=1e9)
    hybrid = dict(type="hybrid", score_threshold=-1.0, candidates=20)
    out = {
        "bm25": RetrieverConfig(type="bm25", **base),
        "dense": RetrieverConfig(type="faiss", **base),
        "hybrid (alpha)": RetrieverConfig(type="hybrid", fusion="alpha", **base),
        "hybrid (rrf)": RetrieverConfig(type="hybrid", fusion="rrf", **base),
        # query typo correction (on by default above) side by side with it off
        "bm25, no typo fix": RetrieverConfig(type="bm25", typo_similarity=None, **base),
        "hybrid (alpha), no typo fix": RetrieverConfig(type="hybrid", fusion="alpha", typo_similarity=None, **base),
        # the default reranker (``auto``), which ships with the package
        "hybrid + rerank": RetrieverConfig(**hybrid, reranker=RerankerConfig(**rerank)),
    }
    if cross_encoder:
        out["hybrid + cross-encoder"] = RetrieverConfig(**hybrid, reranker=RerankerConfig(
            type="cross-encoder", model_dir=cross_encoder, **rerank))
    if reranker_dir:
        out["hybrid + flashrank"] = RetrieverConfig(**hybrid, reranker=RerankerConfig(
            type="flashrank", model_dir=reranker_dir, **rerank))
    return out


def recall(retriever, examples, k: int) -> float:
    hits = retriever.search_batch([e.question for e in examples], k)
    per_q = [len({h.doc_id for h in hs} & set(e.supporting_docs)) / len(e.supporting_docs)
             for e, hs in zip(examples, hits)]
    return sum(per_q) / len(per_q)


def ms_per_query(retriever, questions: list[str], batch: int, k: int = 5) -> float:
    times = []
    for i in range(0, len(questions) - batch + 1, batch):
        chunk = questions[i : i + batch]
        t0 = time.perf_counter()
        retriever.search_batch(chunk, k)
        times.append((time.perf_counter() - t0) * 1e3 / batch)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default=str(DEFAULT_DATA))
    ap.add_argument("--cross-encoder", default=None, help="an ONNX cross-encoder folder (scripts/train_reranker.py)")
    ap.add_argument("--reranker-dir", default=None, help="a folder holding a flashrank model")
    args = ap.parse_args(argv)
    examples, corpus = load_dataset(args.dataset)
    questions = [e.question for e in examples]
    rows = {}
    with tempfile.TemporaryDirectory() as cache:
        for name, cfg in methods(args.cross_encoder, args.reranker_dir).items():
            r = build_retriever(cfg, cache_dir=Path(cache), corpus=corpus)
            inner = getattr(r, "base", r)  # under a reranker
            if hasattr(inner, "embedder"):  # measure search, not the query-embedding cache
                inner.embedder.cache_size = 0
            r.search_batch(questions[:4], 5)  # warm-up
            rows[name] = {f"recall@{k}": recall(r, examples, k) for k in KS}
            rows[name].update({f"ms@{b}": ms_per_query(r, questions, b) for b in BATCHES})
            print(f"[bench] {name} done", file=sys.stderr, flush=True)
    print(f"{len(examples)} questions, {len(corpus)} paragraphs; recall of supporting paragraphs, ms per query")
    table = Table(("method", "<"), *((f"recall@{k}", "{:.3f}") for k in KS),
                  *((f"ms/q @{b}", "{:.2f}") for b in BATCHES))
    for name, m in rows.items():
        table.add(name, *(m[f"recall@{k}"] for k in KS), *(m[f"ms@{b}"] for b in BATCHES))
    table.print()
    emit({
        "bench": "retrieval", "questions": len(examples), "paragraphs": len(corpus),
        "recall@5": {n: round(m["recall@5"], 4) for n, m in rows.items()},
        "ms_per_query": {str(b): {n: round(m[f"ms@{b}"], 3) for n, m in rows.items()} for b in BATCHES},
        "rows": rows,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
