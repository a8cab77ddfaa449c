"""The step's sampling: logits processors, then one token per row.

Processors run in order on the batch's logits (the caller's first, then gating, the hop budget,
no stop inside a query, the query cap, citations): a processor that fails on the batch runs again
row by row, and a row it still fails on ends alone (reason ``error``, an engine error in its
trace). A row samples greedily or with its own generator (temperature, top-p), so it samples the
same tokens in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .options import EngineOptions
from .sequence import Sequence


@dataclass(slots=True)
class Sampled:
    tokens: list[int]
    forced: list[bool]
    """Whether a processor left the row a single token (not the model's choice: mask 0)."""


class Sampler:
    def __init__(self, processors: list, options: EngineOptions):
        """``processors``: the list the engine exposes; callers may insert into it later."""
        self.processors, self.opts = processors, options

    def sample(self, rows: list[Sequence], logits: torch.Tensor, at: list[int], now: float) -> Sampled:
        """A token per row, ``rows[j]`` from the step's logits row ``at[j]`` (the step's logits stay
        untouched: a row-by-row retry starts from them)."""
        try:
            processed = self._process(rows, logits[at])  # indexing by a list copies
        except Exception:  # noqa: BLE001 - find the row(s) it fails on
            parts = []
            for i, s in zip(at, rows):
                try:
                    parts.append(self._process([s], logits[i : i + 1].clone()))
                except Exception as e:  # noqa: BLE001
                    s.fail("applying logits processors", e, now)
                    parts.append(logits[i : i + 1])
            processed = torch.cat(parts)
        forced = ((processed > float("-inf")).sum(dim=-1) == 1).tolist()  # one pass (isfinite + sum: two)
        tokens = processed.argmax(dim=-1).tolist()
        for i, s in enumerate(rows):
            temp = self.opts.temperature if s.temperature is None else s.temperature
            if temp > 0 and not forced[i] and not s.is_finished:
                top_p = self.opts.top_p if s.top_p is None else s.top_p
                tokens[i] = sample_row(processed[i], temp, top_p, s.generator)
        return Sampled(tokens, forced)

    def _process(self, rows: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        for p in self.processors:
            logits = p.apply(rows, logits)
        return logits


def sample_row(logits: torch.Tensor, temperature: float, top_p: float, generator) -> int:
    """One row's token: temperature, then nucleus (top-p) sampling with the row's own generator,
    so a row samples the same tokens whatever batch it is in."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator))
