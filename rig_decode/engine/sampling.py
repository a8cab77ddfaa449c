"""The step's sampling: logits processors, then one token per row.

Processors run in order on the batch's logits (the caller's first, then gating, the hop budget,
no stop inside a query, the query cap, citations): a processor that fails on the batch runs again
row by row, and a row it still fails on ends alone (reason ``error``, an engine error in its
trace). A row samples greedily or with its own generator (temperature, top-p), so it samples the
same tokens in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..logits import numpy_rows
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

    def sample(self, rows: list[Sequence], logits: torch.Tensor, at: list[int], now: float,
               picked: dict[int, int] | None = None) -> Sampled:
        """A token per row, ``rows[j]`` from the step's logits row ``at[j]`` (the step's logits stay
        untouched: a row-by-row retry starts from them). ``picked``: tokens a model server picked
        greedily that the row's bans (``fixed_bans``) do not ban, by logits row: the processors would
        only ban and greedy would pick the same, so those rows are taken as they are and their logits
        rows are not read (per token, the processors are most of what the engine does for a row a
        server decodes)."""
        if picked and any(i in picked for i in at):
            todo = [j for j, i in enumerate(at) if i not in picked]
            tokens, forced = [picked.get(i, -1) for i in at], [False] * len(at)
            if todo:
                rest = self.sample([rows[j] for j in todo], logits, [at[j] for j in todo], now)
                for j, token, f in zip(todo, rest.tokens, rest.forced):
                    tokens[j], forced[j] = token, f
            return Sampled(tokens, forced)
        try:
            processed = self._process(rows, _rows(logits, at))
        except Exception:  # noqa: BLE001 - find the row(s) it fails on
            parts = []
            for i, s in zip(at, rows):
                try:
                    parts.append(self._process([s], logits[i : i + 1].clone()))
                except Exception as e:  # noqa: BLE001
                    s.fail("applying logits processors", e, now)
                    parts.append(logits[i : i + 1])
            processed = torch.cat(parts)
        tokens, forced = greedy(processed)
        for i, s in enumerate(rows):
            temp = self.opts.temperature if s.temperature is None else s.temperature
            if temp > 0 and not forced[i] and not s.is_finished:
                top_p = self.opts.top_p if s.top_p is None else s.top_p
                tokens[i] = sample_row(processed[i], temp, top_p, s.generator)
        return Sampled(tokens, forced)

    def fixed_bans(self, row: Sequence) -> frozenset[int] | None:
        """The ids the processors ban at this row's next position, where bans are all they do there and
        the row picks greedily: a model server that applies them itself (``logit_bias``) then picks
        the token this sampler would pick, with no scores sent back. None where the row samples or a
        processor needs the scores (it forces or moves probability; a processor without
        ``fixed_bans``, such as a caller's or the gate, cannot say)."""
        if (self.opts.temperature if row.temperature is None else row.temperature) > 0:
            return None
        bans = frozenset()
        for p in self.processors:
            try:
                more = p.fixed_bans(row) if hasattr(p, "fixed_bans") else None
            except Exception:  # noqa: BLE001 - the scored path runs it (and deals with its failure)
                return None
            if more is None:
                return None
            bans = bans | more if more else bans
        return bans

    def _process(self, rows: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        for p in self.processors:
            logits = p.apply(rows, logits)
        return logits


def _rows(logits: torch.Tensor, at: list[int]) -> torch.Tensor:
    """A copy of these rows of the step's logits."""
    if numpy_rows(logits):
        return torch.from_numpy(logits.numpy()[at])  # numpy's fancy indexing copies, on this thread
    return logits.index_select(0, torch.tensor(at, device=logits.device))


def greedy(scores: torch.Tensor) -> tuple[list[int], list[bool]]:
    """Each row's greedy token (the first of equal maxima, as ``argmax``) and whether it is the row's
    only finite score (a processor forced it: on numpy rows, "the runner-up is -inf")."""
    if not numpy_rows(scores):
        return scores.argmax(dim=-1).tolist(), (torch.isfinite(scores).sum(dim=-1) == 1).tolist()
    a = scores.numpy()
    rows, best = np.arange(len(a)), a.argmax(axis=-1)
    top = a[rows, best]  # a copy
    a[rows, best] = -np.inf
    runner_up = a.max(axis=-1)
    a[rows, best] = top
    return best.tolist(), (np.isfinite(top) & (runner_up == -np.inf)).tolist()


def sample_row(logits: torch.Tensor, temperature: float, top_p: float, generator) -> int:
    """One row's token: temperature, then nucleus (top-p) sampling with the row's own generator,
    so a row samples the same tokens whatever batch it is in; on the CPU, where the generator lives
    (a CUDA row would refuse it), so a seed draws the same tokens on any device."""
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator))
