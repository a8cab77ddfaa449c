"""Lexical tokenisation for BM25, English and Chinese.

Exact strings matter most to lexical search: order numbers, error codes, versions, model numbers.
A token with inner punctuation (``4.2.1``, ``ORD-2024-001``, ``E1234``) is kept whole, and its
alphanumeric parts are added too, so ``ORD-2024-001`` matches itself exactly and ``2024`` loosely.
Runs of CJK characters are segmented with jieba (search mode, which also emits the sub-words of
long words). English words are lower-cased; a short stop-word list is dropped.
"""

from __future__ import annotations

import logging
import re

_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af"
_W = rf"(?:(?![{_CJK}])[^\W_])"  # a letter or digit that is not CJK
_TOKEN = re.compile(rf"[{_CJK}]+|{_W}+(?:[._\-/:#]{_W}+)*", re.UNICODE)
_CJK_RUN = re.compile(rf"^[{_CJK}]+$")
_SPLIT = re.compile(r"[._\-/:#]")
_STOP = frozenset(
    "a an and are as at be by did do does for from has have how in into is it its of on or that the their "
    "then there these this to was were what when where which who whom whose why will with".split()
)
_jieba = None


def _segment(run: str) -> list[str]:
    global _jieba
    if _jieba is None:
        import jieba

        jieba.setLogLevel(logging.WARNING)
        _jieba = jieba
    return [w for w in _jieba.lcut_for_search(run) if w.strip()]


def has_cjk(text: str) -> bool:
    return re.search(f"[{_CJK}]", text) is not None


def tokenize(text: str) -> list[str]:
    out: list[str] = []
    for m in _TOKEN.finditer(text.lower()):
        tok = m.group()
        if _CJK_RUN.match(tok):
            out += _segment(tok)
        elif tok not in _STOP:
            out.append(tok)
            parts = [p for p in _SPLIT.split(tok) if p]
            if len(parts) > 1:
                out += parts
    return out


_ID_LIKE = re.compile(r"\b(?=[A-Za-z0-9._\-/#]*\d)[A-Za-z0-9]+(?:[._\-/#][A-Za-z0-9]+)+\b|\b[A-Z]{1,5}-?\d{2,}\b|\b\d{3,}\b")
_QUOTED = re.compile(r"\"[^\"]+\"|'[^']{2,}'|“[^”]+”|「[^」]+」")


def exact_terms(query: str) -> list[str]:
    """The parts of a query that must match literally: ids, codes, versions, long numbers, quotes."""
    return [m.group() for m in _ID_LIKE.finditer(query)] + [m.group()[1:-1] for m in _QUOTED.finditer(query)]
