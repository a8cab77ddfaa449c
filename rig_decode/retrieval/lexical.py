"""Lexical search: BM25 (bm25s, sparse matrices) over the tokeniser in ``text.py``, and the
correction of query words the index lacks to the closest indexed word."""

from __future__ import annotations

import re

import numpy as np

from .base import RetrievalError
from .text import tokenize

_WORD = re.compile(r"[^\W\d_]{4,}")  # letters only, four or more: codes and numbers must match exactly


class LexicalSearcher:
    def __init__(self, texts: list[str], k1: float = 1.5, b: float = 0.75):
        import bm25s

        if not texts:
            raise RetrievalError("cannot build a BM25 index over an empty corpus")
        corpus = [tokenize(t) or ["\x00"] for t in texts]  # bm25s wants a token in every document
        self.bm25 = bm25s.BM25(k1=k1, b=b)
        self.bm25.index(corpus, show_progress=False)
        self.ntotal = len(texts)
        self._vocab: list[str] | None = None  # built on the first correction
        self._fixes: dict[tuple[str, float], str | None] = {}  # (word, similarity) -> fix

    def corrections(self, query: str, min_similarity: float) -> dict[str, str]:
        """``{word: indexed word}`` for the query's words (letters only, four or more) that the index
        lacks but holds a word at least ``min_similarity`` alike (rapidfuzz's normalised Indel
        similarity; the closest wins). A model that copies "Drainis" as "Drinkis" into its query
        still finds the document; the caller searches with the corrected words and traces them."""
        from rapidfuzz import fuzz, process

        if self._vocab is None:
            self._vocab = [w for w in self.bm25.vocab_dict if _WORD.fullmatch(w)]
        out = {}
        for word in dict.fromkeys(_WORD.findall(query)):
            low = word.lower()
            if low in self.bm25.vocab_dict or tokenize(low) != [low]:  # indexed, or a stop word
                continue
            key = (low, min_similarity)
            if key not in self._fixes:
                if len(self._fixes) >= 100_000:  # a server sees endless new words: start over
                    self._fixes.clear()
                best = process.extractOne(low, self._vocab, scorer=fuzz.ratio, score_cutoff=100 * min_similarity)
                self._fixes[key] = best[0] if best else None
            if fix := self._fixes[key]:
                out[word] = fix.capitalize() if word[0].isupper() else fix
        return out

    def corrected(self, query: str, min_similarity: float) -> tuple[str, dict[str, str]]:
        """``query`` with ``corrections`` applied, and the corrections."""
        fixes = self.corrections(query, min_similarity)
        return (_WORD.sub(lambda m: fixes.get(m.group(), m.group()), query) if fixes else query), fixes

    def knows(self, term: str, min_similarity: float | None = None) -> bool:
        """Whether the corpus contains every lexical token of ``term`` (False for no tokens); with
        ``min_similarity``, a token that ``corrections`` would replace counts as contained."""
        tokens = tokenize(term)
        missing = [t for t in tokens if t not in self.bm25.vocab_dict]
        if missing and min_similarity:
            fixed = {w.lower() for w in self.corrections(" ".join(missing), min_similarity)}
            missing = [t for t in missing if t not in fixed]
        return bool(tokens) and not missing

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
