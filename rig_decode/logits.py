"""Logits processors that make the retrieval loop terminate by construction.

* ``HopBudgetProcessor``: once a row has completed ``max_iterations`` markers, every token that
  would complete a start delimiter is set to -inf, so no further hop can begin.
* ``QueryCapProcessor``: once an open query has ``max_query_tokens`` tokens, the end delimiter is
  forced token by token.
* ``NoStopInQueryProcessor``: a row cannot end (EOS / stop ids) while a query is open.
* ``StrayEndProcessor``: outside a marker, a token that is a whole end delimiter is banned.

Each processor has two entry points. ``apply(rows, scores)`` is what the engine calls: ``rows`` are
its sequences, each with a ``matcher`` it keeps up to date. ``fixed_bans(row)`` says what ``apply``
would do at the row's next position where that is only banning tokens (the ids; None where it needs
the model's scores): a model server can then apply the rules itself (``logit_bias``) and decode
without sending scores back (``engine/runner_stream.py``). ``pooled(row)`` says which ids'
probability ``apply`` pools into one of them, where that is what it does (the newline rule): a
server's greedy token outside them whose probability beats theirs together is still the pick.
``__call__(input_ids, scores)`` is the HuggingFace ``LogitsProcessor`` signature, so the same objects
plug into ``model.generate``; there a shared ``MarkerTracker`` feeds each row's new tokens
(everything after the prompt) to its matcher.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import LogitsProcessor

from .markers import MarkerMatcher, MarkerVocab

__all__ = [
    "MarkerTracker",
    "HopBudgetProcessor",
    "QueryCapProcessor",
    "NoStopInQueryProcessor",
    "StrayEndProcessor",
    "NewlineEndsQueryProcessor",
    "RetrieveFirstProcessor",
    "marker_processors",
]


@dataclass(slots=True)
class _TrackedRow:
    matcher: MarkerMatcher


class MarkerTracker:
    """Keeps one matcher per row in step with ``input_ids`` across ``generate`` steps."""

    def __init__(self, vocab: MarkerVocab):
        self.vocab = vocab
        self.rows: list[_TrackedRow] = []
        self._seen = 0

    def sync(self, input_ids: torch.Tensor) -> list[_TrackedRow]:
        if not self.rows:  # first step: everything so far is the prompt
            self.rows = [_TrackedRow(MarkerMatcher(self.vocab)) for _ in range(input_ids.shape[0])]
            self._seen = input_ids.shape[1]
        if input_ids.shape[1] > self._seen:
            new = input_ids[:, self._seen :].tolist()
            for row, ids in zip(self.rows, new):
                for t in ids:
                    row.matcher.feed(t)
            self._seen = input_ids.shape[1]
        return self.rows


class _MarkerProcessor(LogitsProcessor):
    def __init__(self, tracker: MarkerTracker | None = None):
        self.tracker = tracker

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.tracker is None:
            raise RuntimeError(f"{type(self).__name__} needs a MarkerTracker to run inside generate()")
        return self.apply(self.tracker.sync(input_ids), scores)

    def apply(self, rows, scores: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def fixed_bans(self, row) -> frozenset[int] | None:
        """The ids ``apply`` bans at this row's next position, where banning is all it does there
        (empty: it does nothing); None where it forces a token or moves probability."""
        return None

    def pooled(self, row) -> tuple[frozenset[int], int] | None:
        """Where ``fixed_bans`` is None because ``apply`` pools the probability of some ids into one
        of them (the rest to -inf) and does nothing else: those ids and the one. None otherwise."""
        return None


NO_BANS: frozenset[int] = frozenset()


def numpy_rows(t: torch.Tensor) -> bool:
    """Whether ``t``'s rows are read and written through numpy: float32 on the CPU. Per token, the
    engine's own work is a few rows over the vocabulary and a few ids in each: there torch's per-op
    overhead is most of the work (its CPU ``argmax`` over 49k scores takes ~10x its ``amax``), and a
    copy or fill of a few rows wakes OpenMP's threads, which cost more than the work and take the
    cores a model server on this machine runs on."""
    return t.device.type == "cpu" and t.dtype == torch.float32 and not t.requires_grad


def _ban(scores: torch.Tensor, i: int, ids: torch.Tensor) -> None:
    """Row ``i`` of ``scores``: these ids to -inf."""
    if numpy_rows(scores):
        scores.numpy()[i, ids.numpy()] = -np.inf
    else:
        scores[i, ids.to(scores.device)] = float("-inf")


def _hop_limit(row, default: int) -> int:
    """A row's hop budget: its own ``max_iterations`` where it has one (engine sequences)."""
    limit = getattr(row, "max_iterations", None)
    return default if limit is None else limit


class HopBudgetProcessor(_MarkerProcessor):
    def __init__(self, vocab: MarkerVocab, max_iterations: int, tracker: MarkerTracker | None = None):
        super().__init__(tracker)
        self.vocab, self.max_iterations = vocab, max_iterations
        self._bans: dict[tuple[int, ...], frozenset[int]] = {}

    def apply(self, rows, scores):
        for i, row in enumerate(rows):
            m = row.matcher
            if m.num_markers >= _hop_limit(row, self.max_iterations) and not m.is_open:
                _ban(scores, i, self.vocab.start_completing_ids(m.start_states))
        return scores

    def fixed_bans(self, row):
        m = row.matcher
        if m.num_markers < _hop_limit(row, self.max_iterations) or m.is_open:
            return NO_BANS
        states = m.start_states
        if states not in self._bans:
            self._bans[states] = frozenset(self.vocab.start_completing_ids(states).tolist())
        return self._bans[states]


class StrayEndProcessor(_MarkerProcessor):
    """Outside a marker an end delimiter means nothing: a token that spells a whole one (an added
    special token) is banned there. A trained model that has used up its hop budget otherwise
    tends to write a query and close it anyway, again and again."""

    def __init__(self, vocab: MarkerVocab, tracker: MarkerTracker | None = None):
        super().__init__(tracker)
        self.ids = vocab.whole_end_ids
        self.bans = frozenset(self.ids.tolist())

    def apply(self, rows, scores):
        if len(self.ids):
            for i, row in enumerate(rows):
                if not row.matcher.is_open:
                    _ban(scores, i, self.ids)
        return scores

    def fixed_bans(self, row):
        return NO_BANS if row.matcher.is_open else self.bans


class QueryCapProcessor(_MarkerProcessor):
    """Forces the end delimiter at the query cap, and completes one the model has begun."""

    def __init__(self, max_query_tokens: int, tracker: MarkerTracker | None = None):
        super().__init__(tracker)
        self.max_query_tokens = max_query_tokens

    def apply(self, rows, scores):
        forced = [(i, row.matcher.next_forced_end()) for i, row in enumerate(rows)
                  if row.matcher.must_close(self.max_query_tokens)]
        return _force(scores, forced)

    def fixed_bans(self, row):
        return None if row.matcher.must_close(self.max_query_tokens) else NO_BANS


class NoStopInQueryProcessor(_MarkerProcessor):
    def __init__(self, stop_ids: list[int], tracker: MarkerTracker | None = None):
        super().__init__(tracker)
        self.stop_ids = torch.tensor(sorted(set(stop_ids)), dtype=torch.long)
        self.bans = frozenset(self.stop_ids.tolist())

    def apply(self, rows, scores):
        if len(self.stop_ids):
            for i, row in enumerate(rows):
                if row.matcher.is_open:
                    _ban(scores, i, self.stop_ids)
        return scores

    def fixed_bans(self, row):
        return self.bans if row.matcher.is_open else NO_BANS


class NewlineEndsQueryProcessor(_MarkerProcessor):
    """Inside a query, a line break means the query is over: the probability of every token that
    contains one moves onto the first token of the end delimiter (whose rest is then forced).

    Models that were never trained on the end delimiter tend to end a query with a newline and
    carry on as if the evidence were already there; this turns that intent into a real marker.
    """

    def __init__(self, vocab: MarkerVocab, tracker: MarkerTracker | None = None):
        super().__init__(tracker)
        self.vocab = vocab
        self._pools: dict[int, frozenset[int]] = {}
        """The pooled ids by the end delimiter's token they go to."""
        self._has_newlines = len(vocab.newline_ids) > 0

    def apply(self, rows, scores):
        newline = self.vocab.newline_ids
        as_numpy = numpy_rows(scores)
        ids = newline.numpy() if as_numpy else newline.to(scores.device)
        for i, row in enumerate(rows):
            m = row.matcher
            if m.is_open and len(newline):
                end = m.next_forced_end()
                if as_numpy:
                    row_scores = scores.numpy()[i]
                    folded = _logsumexp(np.append(row_scores[ids], row_scores[end]))
                    row_scores[ids], row_scores[end] = -np.inf, folded
                else:
                    folded = torch.logsumexp(torch.cat([scores[i, ids], scores[i, end : end + 1]]), 0)
                    scores[i, ids] = float("-inf")
                    scores[i, end] = folded
        return scores

    def fixed_bans(self, row):
        return None if self._has_newlines and row.matcher.is_open else NO_BANS

    def pooled(self, row):
        m = row.matcher
        if not (self._has_newlines and m.is_open):
            return None
        end = m.next_forced_end()
        if end not in self._pools:
            self._pools[end] = frozenset(self.vocab.newline_ids.tolist()) | {end}
        return self._pools[end], end


class RetrieveFirstProcessor(_MarkerProcessor):
    """Forces the start delimiter as the first tokens of every answer: one hop always happens, its
    query written by the model (for models that do not yet decide to retrieve on their own)."""

    def __init__(self, vocab: MarkerVocab, tracker: MarkerTracker | None = None):
        super().__init__(tracker)
        self.start_ids = vocab.tokenizer.encode(vocab.spec.start[0], add_special_tokens=False)

    def apply(self, rows, scores):
        forced = [(i, self.start_ids[len(row.matcher.token_ends)]) for i, row in enumerate(rows) if self._forces(row)]
        return _force(scores, forced)

    def _forces(self, row) -> bool:
        m = row.matcher
        return (len(m.token_ends) < len(self.start_ids) and m.num_markers == 0 and not m.is_open
                and _hop_limit(row, 1) > 0)

    def fixed_bans(self, row):
        return None if self._forces(row) else NO_BANS


def _logsumexp(x: np.ndarray) -> np.float32:
    top = x.max()
    if not np.isfinite(top):
        return top
    return top + np.log(np.exp(x - top).sum(dtype=np.float32))


def _force(scores: torch.Tensor, forced: list[tuple[int, int]]) -> torch.Tensor:
    """Leave only token ``t`` possible in row ``i`` for each ``(i, t)``: two batched writes, not a
    full-row fill per row (per-row fills were most of the processors' time at batch 32)."""
    if forced and numpy_rows(scores):
        rows, ids = [i for i, _ in forced], [t for _, t in forced]
        scores.numpy()[rows] = -np.inf
        scores.numpy()[rows, ids] = 0.0
    elif forced:
        rows = torch.tensor([i for i, _ in forced], device=scores.device)
        ids = torch.tensor([t for _, t in forced], device=scores.device)
        scores[rows] = float("-inf")
        scores[rows, ids] = 0.0
    return scores


def marker_processors(
    vocab: MarkerVocab,
    max_iterations: int,
    max_query_tokens: int,
    stop_ids: list[int],
    newline_ends_query: bool = True,
    retrieve_first: bool = False,
    tracker: MarkerTracker | None = None,
) -> list[_MarkerProcessor]:
    """The processors in the order they must run, sharing one tracker (None: one is made, for
    ``generate``; the engine passes its own rows to ``apply`` and needs none). Forcing goes last
    because it overrides every ban."""
    if tracker is None:
        tracker = MarkerTracker(vocab)
    procs = [HopBudgetProcessor(vocab, max_iterations, tracker), StrayEndProcessor(vocab, tracker),
             NoStopInQueryProcessor(stop_ids, tracker)]
    if retrieve_first and max_iterations > 0:
        procs.append(RetrieveFirstProcessor(vocab, tracker))
    if newline_ends_query:
        procs.append(NewlineEndsQueryProcessor(vocab, tracker))
    procs.append(QueryCapProcessor(max_query_tokens, tracker))
    return procs
