"""Adaptive retrieval gating: decide, at the logits, whether a hop the model wants is worth it.

When a row could open a retrieve marker on this step (the probability mass on tokens that begin
a start delimiter is at least ``consider``), the gate scores the need for retrieval from named
sub-scores, each in [0, 1]:

    marker_prob   probability mass the model puts on opening a marker
    entropy       next-token entropy / ``entropy_scale`` nats (capped at 1): how unsure it is
    need          1 - coverage: the share of the question's key terms (names, numbers, longer
                  words) that the evidence already in context does *not* cover; a name is
                  covered by a document about it (its title), not by a mention in passing. Where
                  the retriever can tell (``knows``: a lexical index), only terms the knowledge
                  base holds count: the rest cannot be looked up
    domain        the highest sensitivity among config rules whose pattern matches the question
                  (time-sensitive or high-stakes topics: always look up)

    score = sum(weight_k * s_k) / sum(weight_k)

Policy: ``score < threshold`` vetoes the marker (its opening tokens are masked for this step and
the model continues); a rule with sensitivity 1 is never vetoed. With ``boost`` on, a row that has
no evidence in context and is unsure (entropy >= ``boost_entropy``) gets ``boost_bias`` added to
the opening tokens' logits (a FLARE-style trigger). Every decision goes into the trace with its
sub-scores and reasons.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import torch

from .citations import key_terms, trace_docs
from .markers import MarkerVocab


@dataclass(frozen=True, slots=True)
class GateRule:
    pattern: str
    sensitivity: float


@dataclass(frozen=True, slots=True)
class GateSettings:
    threshold: float = 0.45
    consider: float = 0.05
    """Only steps where the model gives opening a marker at least this much probability are gated."""
    weights: tuple[tuple[str, float], ...] = (("marker_prob", 1.0), ("entropy", 0.5), ("need", 2.0),
                                              ("domain", 1.0))
    entropy_scale: float = 4.0
    rules: tuple[GateRule, ...] = ()
    boost: bool = False
    boost_entropy: float = 3.0
    boost_bias: float = 4.0


@dataclass(slots=True)
class GateDecision:
    step: int
    """Tokens the row had generated when the decision was taken."""
    action: str
    """allow | veto | boost"""
    score: float
    subscores: dict[str, float]
    reasons: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def opening_ids(vocab: MarkerVocab) -> torch.Tensor:
    """Tokens that, from the beginning of a delimiter, write at least its first two bytes (or all
    of a shorter one): the tokens by which a model opens a marker."""
    ids = []
    for t, data in enumerate(vocab.token_bytes):
        for dfa in vocab.start:
            state = 0
            for byte in data:
                state = dfa.step[state][byte]
                if state == dfa.m:
                    break
            if data and state >= min(2, dfa.m):  # KMP state: the delimiter's prefix the token ends with
                ids.append(t)
                break
    return torch.tensor(ids, dtype=torch.long)


def lookup_terms(question: str, knows: Callable[[str], bool | None] | None = None) -> list[str]:
    """The question's key terms that a search could find: with ``knows`` (the retriever's
    vocabulary check), those the knowledge base holds - "thanks, that helps" has a key word, but
    nothing in the knowledge base to look up."""
    return [t for t in key_terms(question) if knows is None or knows(t) is not False]


def coverage(question: str, docs: Iterable[tuple[str | None, str]],
             knows: Callable[[str], bool | None] | None = None) -> float:
    """Share of the question's ``lookup_terms`` that the evidence in context, ``(title, text)``
    pairs, covers (1.0 when it has none: nothing to look up). A name (capitalised, or holding a
    digit) is covered by a document *about* it, one whose title names it (a document without a
    title: its text); a mention in passing does not count - a company's page names its founder but
    says nothing of where the founder was born. Other key words are covered by any document's text."""
    terms = lookup_terms(question, knows)
    if not terms:
        return 1.0
    docs = list(docs)
    about = " ".join((title or text) for title, text in docs).lower()
    anywhere = " ".join(f"{title or ''} {text}" for title, text in docs).lower()
    covered = sum(t.lower() in (about if _is_name(t) else anywhere) for t in terms)
    return covered / len(terms)


def _is_name(term: str) -> bool:
    return term[0].isupper() or any(c.isdigit() for c in term)


class GateProcessor:
    """Engine logits processor: gates marker openings (veto / allow) and optionally boosts them."""

    def __init__(self, vocab: MarkerVocab, settings: GateSettings = GateSettings(), max_iterations: int | None = None,
                 knows: Callable[[str], bool | None] | None = None):
        self.vocab, self.s, self.max_iterations, self.knows = vocab, settings, max_iterations, knows
        self.opening = opening_ids(vocab)
        self.rules = [(re.compile(r.pattern, re.I), r.sensitivity) for r in settings.rules]
        self.weights = dict(settings.weights)

    def subscores(self, row, logprobs: torch.Tensor) -> dict[str, float]:
        probs = logprobs.exp()
        marker_prob = float(probs[self.opening].sum())
        entropy = float(-(probs * logprobs).nan_to_num().sum())
        question = row.trace.question
        evidence = [(d.title, d.text) for d in trace_docs(row.trace)]
        domain = max((s for rx, s in self.rules if rx.search(question)), default=0.0)
        return {"marker_prob": round(marker_prob, 4), "entropy": round(min(1.0, entropy / self.s.entropy_scale), 4),
                "need": round(1.0 - coverage(question, evidence, self.knows), 4), "domain": round(domain, 4)}

    def score(self, sub: dict[str, float]) -> float:
        total = sum(self.weights.get(k, 0.0) for k in sub)
        return sum(self.weights.get(k, 0.0) * v for k, v in sub.items()) / total if total else 0.0

    def apply(self, rows, scores):
        opening = self.opening.to(scores.device)
        for i, row in enumerate(rows):
            m = row.matcher
            if m.is_open or any(m.start_states) or not _may_retrieve(row, self.max_iterations):
                continue
            logprobs = torch.log_softmax(scores[i].float(), dim=-1)
            p_open = float(logprobs[opening].exp().sum())
            boosted = False
            if self.s.boost and not trace_docs(row.trace) and p_open < self.s.consider:
                entropy = float(-(logprobs.exp() * logprobs).nan_to_num().sum())
                if entropy >= self.s.boost_entropy:
                    sub = self.subscores(row, logprobs)
                    scores[i, opening] += self.s.boost_bias
                    row.trace.gate.append(GateDecision(row.num_generated, "boost", self.score(sub), sub, [
                        f"no evidence in context and entropy {entropy:.2f} >= {self.s.boost_entropy:g} nats"]).to_json())
                    logprobs = torch.log_softmax(scores[i].float(), dim=-1)
                    p_open, boosted = float(logprobs[opening].exp().sum()), True
            if p_open < self.s.consider:
                continue
            sub = self.subscores(row, logprobs)
            score = self.score(sub)
            if sub["domain"] >= 1.0:
                action, reasons = "allow", ["a sensitivity-1 rule matches the question: always retrieve"]
            elif score < self.s.threshold:
                action, reasons = "veto", [f"score {score:.3f} < threshold {self.s.threshold:g}"]
            else:
                action, reasons = "allow", [f"score {score:.3f} >= threshold {self.s.threshold:g}"]
            if sub["need"] == 0.0:
                if key_terms(row.trace.question) and not lookup_terms(row.trace.question, self.knows):
                    reasons.append("none of the question's key terms occurs in the knowledge base")
                else:
                    reasons.append("the evidence in context already covers the question's key terms")
            if boosted:
                reasons.append("after the boost")
            if action == "veto":
                scores[i, opening] = float("-inf")
            row.trace.gate.append(GateDecision(row.num_generated, action, round(score, 4), sub, reasons).to_json())
        return scores


def _may_retrieve(row, default: int | None) -> bool:
    """The row has hops left (its own budget, else the engine's): otherwise nothing to gate."""
    limit = getattr(row, "max_iterations", None)
    limit = default if limit is None else limit
    return limit is None or row.matcher.num_markers < limit


def settings_from_config(cfg) -> GateSettings:
    """``GateSettings`` from a ``rig.gate`` config section."""
    return GateSettings(threshold=cfg.threshold, consider=cfg.consider, weights=tuple(cfg.weights.items()),
                        entropy_scale=cfg.entropy_scale,
                        rules=tuple(GateRule(r.pattern, r.sensitivity) for r in cfg.rules),
                        boost=cfg.boost, boost_entropy=cfg.boost_entropy, boost_bias=cfg.boost_bias)


