"""What a ``RigEngine`` is set to do: hop budget, evidence, sampling, batching, retrieval faults,
and the splice variants (zero-prefill, summary eviction, reuse). Requests override some per
sequence (``RigEngine.new_sequence``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..gate import GateSettings
from ..models.decode_graph import DECODE_STEPS


@dataclass(frozen=True, slots=True)
class EngineOptions:
    max_iterations: int = 3
    max_query_tokens: int = 48
    evidence_token_budget: int = 384
    marker_style: str = "special_token"
    top_k: int = 3
    retrieval_timeout_s: float = 10.0
    retrieval_retries: int = 1
    max_hung_searches: int = 4
    """Abandoned searches (past ``retrieval_timeout_s``) that may still run before retrieval is
    degraded: then hops get a no-evidence block at once instead of a wait."""
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    deadline_s: float | None = None
    newline_ends_query: bool = True
    retrieve_first: bool = False
    max_batch_size: int = 64
    kv_budget_tokens: int | None = None
    """Token slots the KV cache may hold (rows x columns); None: unlimited."""
    sync_retrieval: bool = False
    prefill_chunk_tokens: int | None = None
    """Tokens one prefill forward takes at most (longer ones run in chunks); None: no bound."""
    decode_step: str = "auto"
    """``hf``, ``graph``, ``compiled`` or ``auto`` (``HFModelRunner``)."""
    reprefill: bool = False
    """Reference mode (implies ``sync_retrieval``): a row with evidence to add drops its cache and
    prefills its whole token list again, as string-based RIG systems do; the other rows decode on."""
    citations: bool = False
    """Constrain ``[n]`` citations to documents the row's evidence showed (``citations.py``)."""
    gate: GateSettings | None = None
    """Retrieval gating (``gate.py``); None: every marker the model writes is served."""
    append_format: str = "full"
    """``summary``: when a hop's evidence arrives, the earlier blocks leave the cache (the model's
    own text after each block stays, as its summary of it), so at most one block is kept."""
    zero_prefill: bool = False
    """Splice evidence from per-piece KV computed once, alone (``kernels/chunk_kv.py``), recomputing
    only the block's tail: an approximation of the exact splice (off by default)."""
    zero_prefill_recompute: float = 0.1
    """Share of each block's tokens (at least its last one) recomputed with full attention."""
    zero_prefill_select: str = "tail"
    """Which tokens are recomputed: ``tail``, the block's last ones; ``deviation``, its last one and
    those whose layer-1 values, computed in context, differ most from the reused ones (CacheBlend;
    costs a two-layer pass over the block)."""
    chunk_store_bytes: int = 256 << 20
    """Bytes of piece KV kept on the model's device, least recently used dropped first."""
    chunk_store_host_bytes: int = 0
    """Bytes of piece KV kept in host memory once the device's share is full: a hit there costs a
    copy to the device instead of a forward."""
    reuse_similarity: float | None = None
    """A hop whose query is at least this similar to an earlier one (this answer's, or the
    conversation memory's) references that query's documents instead of searching again."""

    def __post_init__(self):
        if self.append_format not in ("full", "summary"):
            raise ValueError(f"append_format must be full or summary, got {self.append_format!r}")
        if not 0.0 <= self.zero_prefill_recompute <= 1.0:
            raise ValueError(f"zero_prefill_recompute must be in [0, 1], got {self.zero_prefill_recompute}")
        if self.zero_prefill_select not in ("tail", "deviation"):
            raise ValueError(f"zero_prefill_select must be tail or deviation, got {self.zero_prefill_select!r}")
        for name in ("max_batch_size", "max_new_tokens", "top_k", "max_hung_searches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.decode_step not in DECODE_STEPS:
            raise ValueError(f"decode_step must be one of {', '.join(DECODE_STEPS)}, got {self.decode_step!r}")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be at least 1 (or None), got {self.prefill_chunk_tokens}")
        if self.max_iterations < 0:
            raise ValueError(f"max_iterations must be at least 0, got {self.max_iterations}")
        if self.temperature < 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"temperature must be >= 0 and top_p in (0, 1], got {self.temperature}, {self.top_p}")

    @property
    def waits_for_retrieval(self) -> bool:
        """Whether a step waits for the searches it starts (``sync_retrieval``, or reference mode)."""
        return self.sync_retrieval or self.reprefill
