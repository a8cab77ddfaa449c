"""The store-backed retriever: dense, lexical, or hybrid with fusion, routing and fallbacks.

Hybrid search runs dense top-N and BM25 top-M in parallel, merges and de-duplicates the
candidates, and fuses them, either by alpha-weighted min-max normalised scores
(``alpha * dense + (1 - alpha) * bm25``) or by reciprocal rank fusion. A router lowers alpha for
queries that carry exact terms (ids, codes, versions, long numbers, quoted strings), which
embeddings blur and BM25 matches exactly.

Query words the index lacks ("Drinkis", a model's slip copying "Drainis") are replaced by the
closest indexed word when one is similar enough (``typo_similarity``), before both sides search.

Fallback chain: if the dense side fails or exceeds its time limit, the lexical results are used
alone; if both fail, the result is empty and marked so. Every decision lands in the ``HitList.info``
of the query, and from there in the hop's trace.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from .base import Hit, HitList, RetrievalError
from .dense import DenseSearcher, Embedder
from .filters import filter_mask
from .lexical import LexicalSearcher
from .store import IndexStore
from .text import exact_terms

MODES = ("dense", "lexical", "hybrid")
RRF_K = 60


class IndexRetriever:
    def __init__(self, store: IndexStore, embedder: Embedder | None, mode: str = "hybrid", *,
                 alpha: float = 0.7, fusion: str = "alpha", candidates: int = 20, router: bool = True,
                 router_alpha: float = 0.3, score_threshold: float = 0.0, default_filters: dict | None = None,
                 index_type: str = "auto", ann_threshold: int = 50_000, timeout_s: float = 5.0,
                 typo_similarity: float | None = None):
        if mode not in MODES:
            raise RetrievalError(f"unknown retrieval mode {mode!r} ({', '.join(MODES)})")
        if fusion not in ("alpha", "rrf"):
            raise RetrievalError(f"unknown fusion {fusion!r} (alpha or rrf)")
        self.store, self.embedder, self.mode = store, embedder, mode
        self.alpha, self.fusion, self.candidates = alpha, fusion, candidates
        self.router, self.router_alpha = router, router_alpha
        self.score_threshold, self.default_filters, self.timeout_s = score_threshold, default_filters or {}, timeout_s
        self.typo_similarity = typo_similarity
        self.fields = store.metadata_fields
        self.metadatas = [c.metadata for c in store.chunks]
        self.dense = self.lexical = None
        if mode != "lexical":
            if embedder is None:
                raise RetrievalError(f"retrieval mode {mode!r} needs an embedding model")
            if embedder.dim != store.dim:
                raise RetrievalError(f"embedding-dimension mismatch: the index was built with "
                                     f"{store.manifest.get('embedding_model')!r} ({store.dim}-d), the configured "
                                     f"model {embedder.name!r} gives {embedder.dim}-d vectors")
            self.dense = DenseSearcher(store.embeddings, index_type, ann_threshold)
        if mode != "dense":
            self.lexical = LexicalSearcher([c.embed_text() for c in store.chunks])
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="rig-search")

    @property
    def docs(self):
        return self.store.chunks

    def knows(self, term: str) -> bool | None:
        """Whether ``term`` occurs in the indexed text, typo correction included (None without a
        lexical index: unknown)."""
        return None if self.lexical is None else self.lexical.knows(term, self.typo_similarity)

    def search_batch(self, queries: list[str], top_k: int, filters: dict[str, Any] | None = None
                     ) -> list[HitList]:
        if not queries:
            return []
        mask = filter_mask({**self.default_filters, **(filters or {})}, self.metadatas, self.fields)
        n_cand = max(top_k, self.candidates) if self.mode == "hybrid" else top_k
        infos: list[dict[str, Any]] = [{"mode": self.mode} for _ in queries]
        if self.lexical is not None and self.typo_similarity and not filters:
            # (not for a search held to filters, an API key's namespace: the index's whole vocabulary
            # would correct it, and the correction would show words of other namespaces)
            queries = [self._correct(q, info) for q, info in zip(queries, infos)]
        if self.embedder is not None:
            for info in infos:
                info["query_cache_hit_rate"] = round(self.embedder.cache_hit_rate, 3)
        dense_res = lex_res = None
        futures = {}
        if self.dense is not None:
            futures["dense"] = self._pool.submit(self._dense, queries, n_cand, mask)
        if self.lexical is not None:
            futures["lexical"] = self._pool.submit(self.lexical.search, queries, n_cand, mask)
        failures = {}
        for side, fut in futures.items():
            try:
                res = fut.result(timeout=self.timeout_s)
            except FutureTimeout:
                failures[side] = f"{side} search timed out after {self.timeout_s:g}s"
                continue
            except Exception as e:  # noqa: BLE001 - a failing side falls back to the other
                failures[side] = f"{side} search failed: {type(e).__name__}: {e}"
                continue
            if side == "dense":
                dense_res = res
            else:
                lex_res = res
        if dense_res is None and lex_res is None:
            if "lexical" not in futures and self.mode == "dense":
                raise RetrievalError("; ".join(failures.values()))
            reason = "; ".join(failures.values()) + " -> empty result"
            return [HitList([], dict(info, fallback=reason, empty=True)) for info in infos]
        if failures:
            survivor = "lexical" if dense_res is None else "dense"
            for info in infos:
                info["fallback"] = "; ".join(failures.values()) + f" -> {survivor} only"
        out = []
        for qi, q in enumerate(queries):
            d = dense_res[qi] if dense_res is not None else []
            lx = lex_res[qi] if lex_res is not None else []
            alpha = self.alpha
            if self.router and dense_res is not None and lex_res is not None:
                terms = exact_terms(q)
                if terms:
                    alpha = self.router_alpha
                    infos[qi]["router"] = f"exact terms {terms[:4]} -> alpha {alpha:g}"
            if dense_res is not None and lex_res is not None:
                infos[qi].update(fusion=self.fusion, alpha=alpha)
            out.append(HitList(self._fuse(d, lx, alpha, top_k), infos[qi]))
        return out

    def _correct(self, query: str, info: dict[str, Any]) -> str:
        """The query with the words the index lacks replaced by their closest indexed words (both
        sides search with it; ``info["corrected"]`` records each replacement)."""
        query, fixes = self.lexical.corrected(query, self.typo_similarity)
        if fixes:
            info["corrected"] = fixes
        return query

    def _dense(self, queries: list[str], k: int, mask: np.ndarray | None):
        hits = self.dense.search(self.embedder.encode_queries(queries), k, mask)
        return [[(i, s) for i, s in row if s >= self.score_threshold] for row in hits]

    def _fuse(self, dense: list[tuple[int, float]], lexical: list[tuple[int, float]], alpha: float,
              top_k: int) -> list[Hit]:
        both = bool(dense) and bool(lexical)
        scores: dict[int, float] = {}
        raw: dict[int, dict[str, float]] = {}
        if self.fusion == "rrf" and both:
            for side, rows in (("dense", dense), ("bm25", lexical)):
                for rank, (i, s) in enumerate(rows):
                    scores[i] = scores.get(i, 0.0) + 1.0 / (RRF_K + rank + 1)
                    raw.setdefault(i, {})[side] = s
        else:
            for side, rows, w in (("dense", dense, alpha if both else 1.0), ("bm25", lexical, 1 - alpha if both else 1.0)):
                for i, norm, s in _minmax(rows):
                    scores[i] = scores.get(i, 0.0) + w * norm
                    raw.setdefault(i, {})[side] = s
        ranked = sorted(scores, key=lambda i: (-scores[i], i))[:top_k]
        hits = []
        for i in ranked:
            c = self.store.chunks[i]
            sides = raw[i]
            source = "hybrid" if len(sides) == 2 else next(iter(sides))
            meta = dict(c.metadata, chunk_id=c.id, **{f"{k}_score": round(v, 4) for k, v in sides.items()})
            score = scores[i] if both else next(iter(sides.values()))
            hits.append(Hit(c.doc_id, c.text, float(score), c.title, meta, source))
        return hits

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _minmax(rows: list[tuple[int, float]]) -> list[tuple[int, float, float]]:
    if not rows:
        return []
    vals = [s for _, s in rows]
    lo, hi = min(vals), max(vals)
    return [(i, 1.0 if hi == lo else (s - lo) / (hi - lo), s) for i, s in rows]
