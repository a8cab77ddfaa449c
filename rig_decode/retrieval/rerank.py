"""Cross-encoder reranking in process (flashrank, ONNX), within a latency budget.

``RerankingRetriever`` asks its base retriever for ``candidates`` hits per query and reorders them
with the reranker, keeping ``top_n``. Each query has a budget in milliseconds: the reranker's cost
is predicted from what it has measured so far (milliseconds per passage); when a query would exceed
its budget, its hits stay in fusion order and the fallback is recorded. A reranker that raises
falls back the same way. Nothing is downloaded: flashrank fetches a model only when its directory
is missing, and we refuse before that happens.

Good models in flashrank's layout: ``ms-marco-TinyBERT-L-2-v2`` (~4 MB, fastest),
``ms-marco-MiniLM-L-12-v2`` (~34 MB, better), ``ms-marco-MultiBERT-L-12`` (multilingual, for
Chinese corpora). Put the unzipped folder under ``reranker.model_dir``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

from .base import Hit, HitList, RetrievalError, Retriever


class Reranker(Protocol):
    def rerank(self, query: str, hits: list[Hit], top_n: int) -> list[Hit]: ...


class FlashRankReranker:
    def __init__(self, model: str, model_dir: str | Path, max_length: int = 256):
        try:
            from flashrank import Ranker
            from flashrank.Config import model_file_map
        except ImportError:
            raise RetrievalError("reranker type 'flashrank' needs flashrank (pip install 'rig_decode[rerank]')") from None
        if model not in model_file_map:
            raise RetrievalError(f"unknown flashrank model {model!r} (known: {', '.join(model_file_map)})")
        folder = Path(model_dir) / model
        needed = [model_file_map[model], "tokenizer.json", "tokenizer_config.json", "config.json",
                  "special_tokens_map.json"]
        missing = [f for f in needed if not (folder / f).is_file()]
        if missing:
            raise RetrievalError(f"reranker model not found: {folder} lacks {', '.join(missing)} "
                                 "(rig_decode never downloads models; unzip flashrank's model folder there)")
        self.ranker = Ranker(model_name=model, cache_dir=str(model_dir), max_length=max_length, log_level="WARNING")
        self.name = model

    def rerank(self, query: str, hits: list[Hit], top_n: int) -> list[Hit]:
        from flashrank import RerankRequest

        if not hits:
            return []
        passages = [{"id": i, "text": f"{h.title}: {h.text}" if h.title else h.text} for i, h in enumerate(hits)]
        ranked = self.ranker.rerank(RerankRequest(query=query, passages=passages))
        out = []
        for p in ranked[:top_n]:
            h = hits[p["id"]]
            meta = dict(h.metadata, fusion_score=round(h.score, 4))
            out.append(Hit(h.doc_id, h.text, float(p["score"]), h.title, meta, h.source))
        return out


class RerankingRetriever:
    def __init__(self, base: Retriever, reranker: Reranker, top_n: int = 3, candidates: int = 10,
                 budget_ms: float = 200.0):
        self.base, self.reranker = base, reranker
        self.top_n, self.candidates, self.budget_ms = top_n, candidates, budget_ms
        self.ms_per_passage: float | None = None  # running estimate, updated after each call

    @property
    def docs(self):
        return getattr(self.base, "docs", [])

    def knows(self, term: str) -> bool | None:
        knows = getattr(self.base, "knows", None)
        return None if knows is None else knows(term)

    def search_batch(self, queries: list[str], top_k: int, filters: dict[str, Any] | None = None) -> list[HitList]:
        results = self.base.search_batch(queries, max(top_k, self.candidates), filters)
        out = []
        for q, hits in zip(queries, results):
            info = dict(getattr(hits, "info", {}))
            keep = min(top_k, self.top_n)
            predicted = None if self.ms_per_passage is None else self.ms_per_passage * len(hits)
            if predicted is not None and predicted > self.budget_ms:
                info["rerank"] = f"skipped: predicted {predicted:.0f} ms > budget {self.budget_ms:g} ms"
                info["fallback"] = "fusion order (rerank over budget)"
                out.append(HitList(list(hits)[:keep], info))
                continue
            t0 = time.perf_counter()
            try:
                ranked = self.reranker.rerank(q, list(hits), keep)
            except Exception as e:  # noqa: BLE001 - a failing reranker falls back to fusion order
                info["rerank"] = f"failed: {type(e).__name__}: {e}"
                info["fallback"] = "fusion order (rerank failed)"
                out.append(HitList(list(hits)[:keep], info))
                continue
            ms = (time.perf_counter() - t0) * 1e3
            if hits:
                per = ms / len(hits)
                self.ms_per_passage = per if self.ms_per_passage is None else 0.7 * self.ms_per_passage + 0.3 * per
            info["rerank"] = f"{len(hits)} -> {len(ranked)} in {ms:.0f} ms"
            if ms > self.budget_ms:
                info["rerank"] += f" (over the {self.budget_ms:g} ms budget)"
            out.append(HitList(ranked, info))
        return out
