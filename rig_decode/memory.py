"""Evidence memory: what a conversation (or one answer) has already retrieved.

A follow-up question is often about what was just retrieved. The memory keeps the numbered
documents earlier turns spliced and the queries that found them. A new turn's prompt carries those
documents once (numbered as before, so ``[n]`` keeps its meaning), and a hop whose query is a
near-duplicate of an earlier one (token-set similarity >= ``rig.reuse_similarity``), in this
conversation or earlier in the same answer, is answered by a short reference to the documents it
found instead of a new search and a new splice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .retrieval.text import tokenize
from .trace import RetrievedDoc, Trace


def query_similarity(a: str, b: str) -> float:
    """Jaccard similarity of the two queries' word sets (stopwords dropped; codes kept whole)."""
    x, y = set(tokenize(a)), set(tokenize(b))
    if not x or not y:
        return 0.0
    return len(x & y) / len(x | y)


@dataclass(slots=True)
class Reuse:
    similarity: float
    query: str
    """The earlier query it matched."""
    numbers: list[int]
    """The documents (by evidence number) that query found."""


@dataclass(slots=True)
class EvidenceMemory:
    docs: list[RetrievedDoc] = field(default_factory=list)
    """Every document the conversation's answers were shown, with the number it was shown under."""
    queries: list[tuple[str, list[int]]] = field(default_factory=list)
    max_prompt_docs: int = 8
    """A new turn's prompt carries the most recent this many documents (numbers unchanged)."""

    def remember(self, trace: Trace) -> None:
        """Add a finished turn's hops (their documents already carry conversation-wide numbers)."""
        known = {d.id for d in self.docs}
        for step in trace.retrieval_steps:
            for d in step.docs:
                if d.id not in known:
                    known.add(d.id)
                    self.docs.append(RetrievedDoc(d.id, d.title, d.score, d.source, d.number, d.text))
            numbers = [d.number for d in step.docs] or list(step.info.get("reuse", {}).get("numbers", []))
            if numbers:
                self.queries.append((step.query, numbers))

    def in_prompt(self) -> list[RetrievedDoc]:
        return self.docs[-self.max_prompt_docs :] if self.max_prompt_docs else []

    def prompt_text(self) -> str:
        """The block a new turn's prompt carries: the most recent documents, with their numbers."""
        docs = self.in_prompt()
        if not docs:
            return ""
        lines = "".join(f"[{d.number}] {d.title + ': ' if d.title else ''}{' '.join(d.text.split())}\n" for d in docs)
        return f"Evidence retrieved earlier in this conversation:\n<evidence>\n{lines}</evidence>"


def find_reuse(query: str, memory: EvidenceMemory | None, trace: Trace, threshold: float,
               hops_in_context: bool = True) -> Reuse | None:
    """The most similar earlier query (conversation memory, then this answer's hops), when it is
    at least ``threshold`` similar and its documents are still in context. ``hops_in_context``
    false: this answer's evidence blocks leave the cache at its next hop (``append_format:
    summary``), so only documents in the prompt can be pointed to."""
    in_prompt = {d.number for d in memory.in_prompt()} if memory else set()
    candidates = [(q, n) for q, n in memory.queries if set(n) <= in_prompt] if memory else []
    hops = [(s.query, [d.number for d in s.docs] or s.info.get("reuse", {}).get("numbers", []))
            for s in trace.retrieval_steps if s.query]
    candidates += hops if hops_in_context else [(q, n) for q, n in hops if set(n) <= in_prompt]
    best = None
    for earlier, numbers in candidates:
        if not numbers:
            continue
        sim = query_similarity(query, earlier)
        if sim >= threshold and (best is None or sim > best.similarity):
            best = Reuse(round(sim, 4), earlier, list(numbers))
    return best
