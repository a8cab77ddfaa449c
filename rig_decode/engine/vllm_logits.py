"""The marker rules as a vLLM V1 logits processor: hop budget, query cap, no stop inside a query.

Optional (``engine.vllm.logits_processor: true``): the engine applies its own processors to what
vLLM returns and stays the authority. With this processor vLLM's own sampled tokens follow the same
rules, so the prefix mode's lookahead keeps serving steps where a rule would otherwise reject its
prediction (vLLM reports log-probabilities of the raw logits, before any processor, either way).

It works on token ids: the markers must be single tokens (``<|retrieve|>`` / ``<|endofretrieve|>``
added to the tokenizer, as the marker adapters do). Each request carries its settings in
``SamplingParams.extra_args[EXTRA_ARGS_KEY]`` (``MarkerRules.to_extra_args``). Markers are counted
over the prompt (from ``count_from``, so the instruction and memory in the prompt do not count) and
the output: a resumable request is re-added to the batch at every input chunk with the earlier
output folded into its prompt and its output ids cleared.

``MarkerLogitsState`` holds the whole logic and needs no vLLM; ``RigMarkerLogitsProcessor``, the
class vLLM loads, is a thin subclass of vLLM's ``LogitsProcessor`` defined only where vLLM imports.
It implements the V1 model runner's interface (``VLLM_USE_V2_MODEL_RUNNER=0`` on releases whose
default runner takes the V2 interface, 0.33.0 among them: its V2 runner refuses a class that is
not a ``vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor``; ``runner_vllm.vllm_runner``
sets it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EXTRA_ARGS_KEY = "rig_markers"


@dataclass(frozen=True)
class MarkerRules:
    start_id: int
    end_id: int
    stop_ids: tuple[int, ...]
    max_iterations: int
    max_query_tokens: int
    count_from: int = 0
    """Prompt tokens before this index are not scanned for markers."""

    def to_extra_args(self, count_from: int | None = None) -> dict:
        return {EXTRA_ARGS_KEY: {"start_id": self.start_id, "end_id": self.end_id, "stop_ids": list(self.stop_ids),
                                 "max_iterations": self.max_iterations, "max_query_tokens": self.max_query_tokens,
                                 "count_from": self.count_from if count_from is None else count_from}}

    @classmethod
    def from_extra_args(cls, extra_args: dict | None) -> "MarkerRules | None":
        """The rules a request carries; None when it carries none. ValueError when malformed."""
        raw = (extra_args or {}).get(EXTRA_ARGS_KEY)
        if raw is None:
            return None
        try:
            rules = cls(int(raw["start_id"]), int(raw["end_id"]), tuple(int(t) for t in raw.get("stop_ids", ())),
                        int(raw["max_iterations"]), int(raw["max_query_tokens"]), int(raw.get("count_from", 0)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"extra_args[{EXTRA_ARGS_KEY!r}] is malformed: {e!r}") from None
        if rules.max_iterations < 0 or rules.max_query_tokens < 1 or rules.count_from < 0:
            raise ValueError(f"extra_args[{EXTRA_ARGS_KEY!r}]: max_iterations >= 0, max_query_tokens >= 1 and "
                             "count_from >= 0 are required")
        return rules

    @classmethod
    def from_tokenizer(cls, tokenizer, stop_ids, max_iterations: int, max_query_tokens: int) -> "MarkerRules":
        from ..markers import MarkerSpec

        spec = MarkerSpec.special_token()
        ids = [tokenizer.encode(text, add_special_tokens=False) for text in (spec.start[0], spec.end[0])]
        if any(len(i) != 1 for i in ids):
            raise ValueError(f"the marker logits processor needs {spec.start[0]} and {spec.end[0]} as single tokens "
                             "of the tokenizer (a marker adapter's tokenizer adds them); this one splits them")
        return cls(ids[0][0], ids[1][0], tuple(sorted(set(stop_ids))), max_iterations, max_query_tokens)


class _RequestState:
    """Where one request stands: markers completed, whether a query is open and how long it is.
    Scans each token once: the prompt when the request joins, the live output list as it grows."""

    def __init__(self, rules: MarkerRules, prompt_ids: list[int] | None, output_ids: list[int]):
        self.rules, self.output_ids = rules, output_ids
        self.markers, self.open, self.query_len = 0, False, 0
        for t in (prompt_ids or [])[rules.count_from:]:
            self._feed(t)
        self._after_prompt = (self.markers, self.open, self.query_len)
        self.seen = 0

    def _feed(self, t: int) -> None:
        if self.open:
            if t == self.rules.end_id:
                self.open, self.markers = False, self.markers + 1
            else:
                self.query_len += 1
        elif t == self.rules.start_id:
            self.open, self.query_len = True, 0

    def sync(self) -> None:
        if len(self.output_ids) < self.seen:  # the list was cleared: count it again from the prompt
            (self.markers, self.open, self.query_len), self.seen = self._after_prompt, 0
        for t in self.output_ids[self.seen:]:
            self._feed(t)
        self.seen = len(self.output_ids)

    def decide(self) -> tuple[list[int], int | None]:
        """(token ids to ban, the token to force or None) for the next position."""
        self.sync()
        r = self.rules
        if self.open:
            if self.query_len >= r.max_query_tokens:
                return [], r.end_id
            return list(r.stop_ids), None
        if self.markers >= r.max_iterations:
            return [r.start_id], None
        return [], None


class MarkerLogitsState:
    """Per-batch-slot request states, kept in step with vLLM's ``BatchUpdate``s."""

    def __init__(self):
        self.requests: dict[int, _RequestState] = {}

    @staticmethod
    def validate(sampling_params) -> None:
        MarkerRules.from_extra_args(getattr(sampling_params, "extra_args", None))

    def update(self, batch_update) -> None:
        """``batch_update``: None (same batch) or an object with ``removed``, ``added`` as
        ``(index, params, prompt_ids, output_ids)`` and ``moved`` as ``(a, b, direction)``."""
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.requests.pop(index, None)
        for index, params, prompt_ids, output_ids in batch_update.added:
            rules = MarkerRules.from_extra_args(getattr(params, "extra_args", None))
            if rules is None:
                self.requests.pop(index, None)
            else:
                self.requests[index] = _RequestState(rules, prompt_ids, output_ids)
        for a, b, direction in batch_update.moved:
            sa, sb = self.requests.pop(a, None), self.requests.pop(b, None)
            if sa is not None:
                self.requests[b] = sa
            if sb is not None and getattr(direction, "name", direction) == "SWAP":
                self.requests[a] = sb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        banned_rows, banned_ids, forced = [], [], []
        for index, state in self.requests.items():
            ban, force = state.decide()
            if force is not None:
                forced.append((index, force))
            banned_rows += [index] * len(ban)
            banned_ids += ban
        if banned_rows:
            logits[torch.tensor(banned_rows, device=logits.device),
                   torch.tensor(banned_ids, device=logits.device)] = float("-inf")
        if forced:
            rows = torch.tensor([i for i, _ in forced], device=logits.device)
            ids = torch.tensor([t for _, t in forced], device=logits.device)
            kept = logits[rows, ids]
            logits[rows] = float("-inf")
            logits[rows, ids] = torch.where(torch.isfinite(kept), kept, torch.zeros_like(kept))
        return logits


try:
    from vllm.v1.sample.logits_processor import LogitsProcessor as _VllmLogitsProcessor
except ImportError:
    _VllmLogitsProcessor = None

if _VllmLogitsProcessor is not None:

    class RigMarkerLogitsProcessor(_VllmLogitsProcessor):
        """vLLM's handle on ``MarkerLogitsState``."""

        @classmethod
        def validate_params(cls, sampling_params):
            MarkerLogitsState.validate(sampling_params)

        def __init__(self, vllm_config, device, is_pin_memory: bool):
            self.state = MarkerLogitsState()

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update) -> None:
            self.state.update(batch_update)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            return self.state.apply(logits)
