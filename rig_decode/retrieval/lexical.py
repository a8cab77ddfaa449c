"""Lexical search: BM25 (bm25s, sparse matrices) over the tokeniser in ``text.py``."""

from __future__ import annotations

import numpy as np

from .base import RetrievalError
from .text import tokenize


class LexicalSearcher:
    def __init__(self, texts: list[str], k1: float = 1.5, b: float = 0.75):
        import bm25s

        if not texts:
            raise RetrievalError("cannot build a BM25 index over an empty corpus")
        corpus = [tokenize(t) or ["\x00"] for t in texts]  # bm25s wants a token in every document
        self.bm25 = bm25s.BM25(k1=k1, b=b)
        self.bm25.index(corpus, show_progress=False)
        self.ntotal = len(texts)

    def knows(self, term: str) -> bool:
        """Whether the corpus contains every lexical token of ``term`` (False for no tokens)."""
        tokens = tokenize(term)
        return bool(tokens) and all(t in self.bm25.vocab_dict for t in tokens)

    def search(self, queries: list[str], k: int, mask: np.ndarray | None = None
               ) -> list[list[tuple[int, float]]]:
        """Per query, up to ``k`` (row, BM25 score) pairs with a positive score, best first."""
        tokens = [tokenize(q) for q in queries]
        out: list[list[tuple[int, float]]] = [[] for _ in queries]
        todo = [i for i, t in enumerate(tokens) if t]
        k = min(k, self.ntotal)
        if not todo or k == 0:
            return out
        weights = None if mask is None else mask.astype(np.float32)
        ids, scores = self.bm25.retrieve([tokens[i] for i in todo], k=k, show_progress=False,
                                         weight_mask=weights, n_threads=1)
        for row, irow, srow in zip(todo, ids.tolist(), scores.tolist()):
            out[row] = [(i, s) for i, s in zip(irow, srow) if s > 0]
        return out
