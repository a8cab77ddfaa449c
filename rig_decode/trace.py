"""What happened during one request: every hop with its query, hits, timings and token counts."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class RetrievedDoc:
    id: str
    title: str | None
    score: float
    source: str
    number: int = 0
    """Its number in the evidence (``[n]``), counted across the sequence's hops."""
    text: str = ""
    """The text the evidence block showed (for checking citations against it)."""


@dataclass(slots=True)
class RetrievalStep:
    round: int
    """1-based hop number within the request."""
    query: str
    docs: list[RetrievedDoc] = field(default_factory=list)
    latency_ms: float = 0.0
    """Time spent in search (and rerank) for the batch this hop was part of."""
    evidence_tokens: int = 0
    """Tokens spliced into the cache for this hop (the pending end-marker token not counted)."""
    splice_ms: float = 0.0
    first_token_ms: float | None = None
    """From the marker's completion to the first token sampled after the evidence: the whole hop as
    the row saw it (None: the row finished at this marker)."""
    position: int = 0
    """Index in the sequence's token list where the evidence starts."""
    batch_size: int = 1
    """How many queries went to the retriever in the same ``search_batch`` call."""
    error: str | None = None
    fallback: str | None = None
    info: dict = field(default_factory=dict)
    """The retriever's decisions for this query: mode, fusion weights, router, rerank."""


@dataclass(slots=True)
class Trace:
    question: str = ""
    retrieval_steps: list[RetrievalStep] = field(default_factory=list)
    marker_errors: list[str] = field(default_factory=list)
    """Markers the model wrote wrong (empty, garbled, two in one token): the model's mistakes."""
    engine_errors: list[str] = field(default_factory=list)
    """Failures of the engine itself while serving this request (a processor that raised, a splice
    that failed, a step that failed for the whole batch): never the model's fault."""
    prompt_tokens: int = 0
    generated_tokens: int = 0
    """Tokens the model produced (sampled, plus end markers forced at the query cap)."""
    evidence_tokens: int = 0
    marker_tokens: int = 0
    prompt_marker_tokens: int = 0
    """Marker delimiter tokens in a token-id prompt: the client's own (they start no hop). A text
    prompt has none: its marker strings are encoded as text."""
    ttft_ms: float = 0.0
    decode_ms: float = 0.0
    retrieval_ms: float = 0.0
    splice_ms: float = 0.0
    queue_ms: float = 0.0
    """Time waiting for admission (KV budget, batch size)."""
    parked_ms: float = 0.0
    """Time parked in RETRIEVING while other rows decoded."""
    total_ms: float = 0.0
    finish_reason: str = ""
    evicted_tokens: int = 0
    """Evidence tokens dropped from the cache again (``append_format: summary``)."""
    citations: list[dict] = field(default_factory=list)
    """``[n]`` citations of the answer: document, sentence, valid, supported (``citations.py``)."""
    gate: list[dict] = field(default_factory=list)
    """Retrieval-gate decisions (allow / veto / boost) with their sub-scores (``gate.py``)."""
    memory_docs: list[RetrievedDoc] = field(default_factory=list)
    """Documents the prompt carried from earlier turns (numbered 1..len); this answer's continue."""

    @property
    def num_hops(self) -> int:
        return len(self.retrieval_steps)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["num_hops"] = self.num_hops
        return d

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, **kwargs)
