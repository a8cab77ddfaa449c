"""One request's decoding state.

``token_ids`` only grows: prompt, sampled tokens, forced tokens and evidence are appended and never
re-encoded. ``mask`` runs beside it (1 = sampled by the model, 0 = prompt, evidence or forced), the
same mask training uses to keep evidence out of the loss. ``pending`` holds the tail of
``token_ids`` that the model has not seen yet: one sampled token on a decode step, or the
marker-completing token plus the evidence block after a hop, which is then prefilled in one go.
With ``append_format: summary`` the cache drops old evidence blocks (``evicted``): it holds
``kept_ids``, the token list minus those spans.

A sequence also carries its answer as text (``answer``: the visible text, markers hidden, or the
raw completion; cut at the request's stop strings) and is finished in one place, ``finish``, for
every caller (session, server, eval): the answer's last text, its citations checked against the
documents its hops showed, and the conversation's memory told what this turn retrieved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from ..citations import check_citations, trace_docs
from ..markers import MarkerMatcher
from ..memory import EvidenceMemory
from ..textstream import TextDeltas
from ..trace import RetrievalStep, Trace


@dataclass(slots=True)
class PendingBlock:
    """An evidence block whose first ``count`` tokens are spliced from precomputed piece KV
    (``kernels/chunk_kv.py``) rather than computed: its tokens, its pieces' lengths (``segments``)
    and leads, and how many of the copied tokens the runner recomputes by deviation (``reselect``,
    CacheBlend)."""

    token_ids: list[int]
    segments: list[int]
    count: int
    leads: list[list[int]]
    reselect: int = 0

    def pieces(self) -> tuple:
        """What ``ChunkKVStore.blocks_kv`` takes for it."""
        return self.token_ids, self.segments, self.count, self.leads


class SequenceStatus(Enum):
    WAITING = "waiting"  # queued, not in the batch yet
    RUNNING = "running"
    RETRIEVING = "retrieving"  # in the batch, parked until its evidence arrives
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    matcher: MarkerMatcher
    max_new_tokens: int
    generator: torch.Generator | None = None
    token_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_generated: int = 0
    finish_reason: str | None = None
    query: str | None = None
    """The query of the marker just completed, while the sequence is RETRIEVING."""
    trace: Trace = field(default_factory=Trace)
    arrival: float = 0.0
    """``time.perf_counter()`` when the engine received it."""
    deadline_at: float | None = None
    ticket: int = 0
    """The retrieval worker's ticket of the search this sequence waits for (0: none)."""
    parked_at: float = 0.0
    fed_at: float | None = None
    """When the runner was handed the row's pending tokens (a model server's token may take several
    steps to come)."""
    cancelled: bool = False
    # per-request overrides of the engine's options (None: the engine's)
    max_iterations: int | None = None
    top_k: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    filters: dict | None = None
    """Metadata filters of this request's searches (its API key's namespace), over the retriever's own."""
    memory: EvidenceMemory | None = None
    """The conversation's evidence memory (documents its prompt carries, earlier queries)."""
    evidence_spans: list[tuple[int, int]] = field(default_factory=list)
    """``token_ids`` spans of the evidence blocks the cache still holds."""
    evicted: list[tuple[int, int]] = field(default_factory=list)
    """``token_ids`` spans the cache dropped, in order."""
    staged: PendingBlock | None = None
    """The evidence block just queued, to splice from precomputed KV (zero-prefill): the next
    step assembles it, with every other row's, and consumes it."""
    hop_info: dict = field(default_factory=dict)
    """What the coming hop's ``RetrievalStep.info`` records beside the retriever's (a failed reuse
    lookup, say)."""
    answer: TextDeltas | None = None
    """The answer's text as it becomes final (``advance_answer``); its stop strings end the sequence."""
    answer_at: int = 0
    """Tokens of ``token_ids`` the answer has seen."""

    def __post_init__(self):
        self.token_ids = list(self.prompt_ids)
        self.mask = [0] * len(self.prompt_ids)
        self.pending = list(self.prompt_ids)
        self.answer_at = len(self.prompt_ids)
        self.trace.prompt_tokens = len(self.prompt_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def has_evidence_pending(self) -> bool:
        """A hop's evidence (behind the marker's last token) waits to be prefilled."""
        return len(self.pending) > 1 and self.num_generated > 0

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_kept(self) -> int:
        """Tokens of ``token_ids`` the cache holds (or will, once ``pending`` is fed)."""
        return len(self.token_ids) - sum(e - s for s, e in self.evicted)

    @property
    def kept_ids(self) -> list[int]:
        if not self.evicted:
            return list(self.token_ids)
        out, at = [], 0
        for s, e in self.evicted:
            out += self.token_ids[at:s]
            at = e
        return out + self.token_ids[at:]

    def kept_index(self, p: int) -> int:
        """Where ``token_ids[p]`` (not itself evicted) sits among the kept tokens."""
        return p - sum(e - s for s, e in self.evicted if e <= p)

    def append(self, token_ids: list[int], sampled: bool) -> None:
        self.token_ids += token_ids
        self.mask += [int(sampled)] * len(token_ids)
        self.pending += token_ids

    @property
    def answer_text(self) -> str:
        """The answer handed out so far (all of it once finished)."""
        return self.answer.text if self.answer is not None else self.matcher.visible_text().lstrip()

    def advance_answer(self, final: bool = False, upto: int | None = None) -> str:
        """The answer's text that became final since the last call (all the rest when ``final``),
        from the tokens up to ``upto`` (default: all; the raw answer shows them); after a stop
        string, nothing more."""
        if self.answer is None:
            return ""
        upto = len(self.token_ids) if upto is None or final else max(self.answer_at, upto)
        if upto == self.answer_at and not final:
            return ""  # no token since the last call: the text is what it was (no O(answer) rebuild)
        new, self.answer_at = self.token_ids[self.answer_at : upto], upto
        return self.answer.feed(new, self.matcher.visible_bytes(final=final), final=final)

    @property
    def hit_stop_string(self) -> bool:
        return self.answer is not None and self.answer.stopped

    def finish(self, reason: str, now: float, step: RetrievalStep | None = None) -> None:
        """End the sequence. One parked on a marker gets that hop recorded (``step``, or one saying
        why no evidence came), so every marker it completed has its ``RetrievalStep``."""
        if self.status is SequenceStatus.RETRIEVING:
            if step is None:
                step = RetrievalStep(self.matcher.num_markers, self.query or "",
                                     error=_UNSERVED.get(reason, f"{reason} at the marker; no retrieval"),
                                     position=len(self.token_ids))
                if self.parked_at:
                    step.latency_ms = (now - self.parked_at) * 1e3
            step.fallback = step.fallback or "no evidence: finished"
            self.trace.retrieval_steps.append(step)
        self.ticket = 0  # a search still in flight is dropped when it returns
        self.status, self.finish_reason = SequenceStatus.FINISHED, reason
        self.pending.clear()
        self.staged = None
        self.trace.finish_reason = reason
        self.trace.total_ms = (now - self.arrival) * 1e3
        self.trace.marker_tokens = self.matcher.num_marker_tokens()
        self.advance_answer(final=True)
        self.trace.citations = [c.to_json() for c in check_citations(self.answer_text, trace_docs(self.trace))]
        if self.memory is not None and reason not in ("error", "cancelled"):  # a turn the client saw
            self.memory.remember(self.trace)

    def fail(self, what: str, error: BaseException | str, now: float, step: RetrievalStep | None = None) -> None:
        """The engine failed while ``what`` for this sequence: the failure is recorded as an
        engine error (never a marker error: the model did nothing wrong) and the sequence ends
        with reason ``error``; its cache leaves the batch at the next step."""
        why = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.trace.engine_errors.append(f"{what}: {why}" if what else why)
        if not self.is_finished:
            self.finish("error", now, step)


_UNSERVED = {"length": "token limit reached at the marker; no retrieval",
             "context_full": "context full at the marker; no retrieval",
             "deadline": "deadline passed before the evidence came; no retrieval",
             "cancelled": "cancelled before the evidence came; no retrieval",
             "error": "the row failed before its evidence came; no retrieval"}
