"""The retrieval protocol every backend implements, and the records it passes around."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(slots=True)
class Document:
    doc_id: str
    text: str
    title: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Hit:
    doc_id: str
    text: str
    score: float
    title: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    source: str = "dense"


class HitList(list):
    """The hits for one query, best first, plus ``info``: what the retriever decided for this query
    (fusion weights, router reason, reranking, fallbacks), recorded in the hop's trace."""

    def __init__(self, hits=(), info: dict[str, Any] | None = None):
        super().__init__(hits)
        self.info = info or {}


class RetrievalError(RuntimeError):
    """A retriever that cannot serve: missing or corrupt index, bad embedding model, bad query."""


@runtime_checkable
class Retriever(Protocol):
    def search_batch(
        self, queries: list[str], top_k: int, filters: dict[str, Any] | None = None
    ) -> list[list[Hit]]:
        """One list of hits per query, best first (a ``HitList`` may carry per-query decisions).
        Called once per scheduler step for every sequence that is waiting on evidence. A retriever
        may also offer ``knows(term) -> bool | None``: whether the knowledge base holds a term (the
        retrieval gate counts only terms a search could find)."""
        ...
