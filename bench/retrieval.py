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

With ``--random-index ROWS`` (``--device``, ``--cap-gib``): search latency at scale instead, top-10
for 8 queries over ROWS random unit 384-d vectors resident on the device (FAISS on the GPU when the
installed faiss has GPU support, else a matmul + ``torch.topk`` on the device), and reranking 20
passages with flashrank when its model is already on disk (never downloaded)::

    python bench/retrieval.py --random-index 1000000 --device cuda

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from rig_decode.config import RerankerConfig, RetrieverConfig
from rig_decode.eval.datasets import load_dataset
from rig_decode.retrieval.base import Hit
from rig_decode.retrieval.factory import build_retriever

from harness import Table, emit  # bench/ is on sys.path when run as a script
from timing import Clock, cap_memory, pick_device

KS = (2, 5, 10)
BATCHES = (1, 8, 32)
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "hotpotqa_dev_100.jsonl"
EMBED_DIM, QUERIES, TOP_K, PASSAGES = 384, 8, 10, 20


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


# -- at scale: a random index on the device (--random-index) -------------------------------------------


class DeviceIndex:
    """``rows`` random unit ``EMBED_DIM``-d vectors on ``device`` (fp16 on CUDA), built in slices so
    the fp32 draft never holds the whole matrix; on CUDA with faiss-gpu, a flat inner-product FAISS
    index holds them instead, outside torch's allocator (``outside_torch``: its bytes and scratch)."""

    def __init__(self, rows: int, device, seed: int = 1):
        self.rows, self.device = rows, device
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        gen = torch.Generator(device=device).manual_seed(seed)
        vectors = torch.empty(rows, EMBED_DIM, device=device, dtype=dtype)
        for start in range(0, rows, 100_000):
            end = min(rows, start + 100_000)
            block = torch.randn(end - start, EMBED_DIM, device=device, generator=gen)
            vectors[start:end] = torch.nn.functional.normalize(block, dim=1).to(dtype)
        self.nbytes, self.dtype = vectors.nbytes, str(dtype).removeprefix("torch.")
        self.faiss, self.outside_torch = self._faiss_gpu(vectors), 0
        self.vectors = None if self.faiss is not None else vectors
        if self.faiss is not None:
            self.outside_torch = vectors.nbytes + (256 << 20)
        self.backend = "faiss-gpu flat IP" if self.faiss is not None else "matmul + torch.topk"

    def _faiss_gpu(self, vectors):
        if self.device.type != "cuda":
            return None
        try:
            import faiss
        except ImportError:
            return None
        if not hasattr(faiss, "GpuIndexFlatIP") or faiss.get_num_gpus() < 1:
            return None
        self._resources = faiss.StandardGpuResources()  # the index needs its resources alive
        self._resources.setTempMemory(256 << 20)  # its default scratch (1.5 GiB) would sit outside a cap
        cfg = faiss.GpuIndexFlatConfig()
        cfg.useFloat16, cfg.device = True, self.device.index or 0
        flat = faiss.GpuIndexFlatIP(self._resources, EMBED_DIM, cfg)
        for start in range(0, vectors.shape[0], 100_000):
            flat.add(vectors[start : start + 100_000].float().cpu().numpy())
        return flat

    def searcher(self, queries):
        """A call that searches ``queries`` (unit vectors on the device) for their top ``TOP_K``."""
        if self.faiss is not None:
            host = queries.cpu().numpy()
            return lambda: self.faiss.search(host, TOP_K)
        q = queries.to(self.vectors.dtype)
        return lambda: torch.topk(q @ self.vectors.T, TOP_K, dim=1)


def search_ms(index: DeviceIndex, repeats: int, clock, seed: int = 2) -> float:
    """Milliseconds of one top-``TOP_K`` search for ``QUERIES`` random queries (the median of ``repeats``)."""
    gen = torch.Generator(device=index.device).manual_seed(seed)
    queries = torch.nn.functional.normalize(torch.randn(QUERIES, EMBED_DIM, device=index.device, generator=gen), dim=1)
    return clock.median_ms(index.searcher(queries), repeats)


def load_reranker():
    """(reranker, None), or (None, why not): flashrank must be installed and its model on disk."""
    from rig_decode.models.embedded import cache_dir
    from rig_decode.retrieval.base import RetrievalError
    from rig_decode.retrieval.rerank import FlashRankReranker

    try:
        return FlashRankReranker(RerankerConfig().model, cache_dir() / "rerankers"), None
    except RetrievalError as e:
        return None, str(e)


def rerank_ms(reranker, repeats: int, clock, seed: int = 3) -> float:
    """Milliseconds to rerank ``PASSAGES`` passages of 80 random words (the median of ``repeats``)."""
    words = "release gateway error fixed changelog version tls handshake timeout retry".split()
    gen = torch.Generator().manual_seed(seed)
    hits = [Hit(f"d{i}", " ".join(words[j] for j in torch.randint(0, len(words), (80,), generator=gen).tolist()),
                1.0 - i / PASSAGES, title=f"doc {i}") for i in range(PASSAGES)]
    return clock.median_ms(lambda: reranker.rerank("which release fixed error E1234", hits, PASSAGES), repeats)


def at_scale(args) -> int:
    """``--random-index``: search and rerank latency on the device."""
    device = pick_device(args.device)
    cap_memory(device, int(args.cap_gib * (1 << 30)) if args.cap_gib else None)
    clock, index = Clock(device), DeviceIndex(args.random_index, device)
    search = search_ms(index, 10, clock)
    reranker, why = load_reranker()
    rerank = rerank_ms(reranker, 3, clock) if reranker is not None else None
    table = Table(("what", "<"), ("ms", "{:.3f}"), ("how", "<"))
    table.add(f"top-{TOP_K} of {index.rows:,}, {QUERIES} queries", search, index.backend)
    table.add(f"rerank {PASSAGES} passages", rerank, reranker.name if reranker is not None else f"n/a: {why}")
    table.print()
    emit({"bench": "retrieval", "random_index": index.rows, "device": str(device), "index_gb": index.nbytes / (1 << 30),
          "search_ms": search, "search_backend": index.backend, "rerank_ms": rerank,
          **({"rerank_na": why} if reranker is None else {})}, digits=4)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default=str(DEFAULT_DATA))
    ap.add_argument("--cross-encoder", default=None, help="an ONNX cross-encoder folder (scripts/train_reranker.py)")
    ap.add_argument("--reranker-dir", default=None, help="a folder holding a flashrank model")
    ap.add_argument("--random-index", type=int, metavar="ROWS", help="search latency over ROWS random vectors instead")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="with --random-index")
    ap.add_argument("--cap-gib", type=float, help="with --random-index: cap the card's memory at this many GiB")
    args = ap.parse_args(argv)
    if args.random_index:
        return at_scale(args)
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
