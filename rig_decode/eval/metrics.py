"""Answer and retrieval metrics, per question and aggregated.

Answer normalisation is the standard SQuAD/HotpotQA one (lower-case, drop punctuation and the
articles a/an/the, collapse whitespace). ``accuracy`` counts an answer as correct when a normalised
gold answer occurs in the normalised prediction: models answer in sentences, so exact match alone
under-counts right answers.
"""

from __future__ import annotations

import re
import string
from collections import Counter

import numpy as np

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)
_SOURCE_CLAIM = re.compile(
    r"\b(according to|based on|as stated in|as shown in|the (provided )?(documents?|evidence|sources?|search results?)"
    r" (say|says|state|states|show|shows|indicate|indicates))\b"
    r"|\baccording to the (documents?|evidence|sources?|search results?|context)\b",
    re.IGNORECASE,
)


def normalize_answer(s: str) -> str:
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def exact_match(prediction: str, answers: list[str]) -> float:
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(a) for a in answers))


def f1_score(prediction: str, answers: list[str]) -> float:
    def f1(pred: str, gold: str) -> float:
        p, g = normalize_answer(pred).split(), normalize_answer(gold).split()
        common = Counter(p) & Counter(g)
        same = sum(common.values())
        if not p or not g:
            return float(p == g)
        if same == 0:
            return 0.0
        precision, recall = same / len(p), same / len(g)
        return 2 * precision * recall / (precision + recall)

    return max(f1(prediction, a) for a in answers)


def contains_answer(prediction: str, answers: list[str]) -> float:
    p = f" {normalize_answer(prediction)} "
    return float(any(f" {normalize_answer(a)} " in p for a in answers if normalize_answer(a)))


def claims_sources(text: str) -> bool:
    """Does the answer say it rests on documents/evidence ("according to the documents ...")?"""
    return bool(_SOURCE_CLAIM.search(text))


def hop_is_relevant(doc_ids: list[str], doc_texts: list[str], gold_ids: list[str], answers: list[str]) -> bool:
    """A hop is relevant when it retrieved a gold supporting document or, without gold ids, a
    document that contains the answer."""
    if gold_ids:
        return bool(set(doc_ids) & set(gold_ids))
    return any(contains_answer(t, answers) for t in doc_texts)


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None
