"""The step's sampling: logits processors, then one token per row.

Processors run in order on the batch's logits (the caller's first, then gating, the hop budget,
no stop inside a query, the query cap, citations): a processor that fails on the batch runs again
row by row, and a row it still fails on ends alone (reason ``error``, an engine error in its
trace). A row samples greedily or with its own generator (temperature, top-p), so it samples the
same tokens in any batch.
"""

from __future__ import annotations

import math
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


@dataclass(frozen=True, slots=True)
class PickRule:
    """The processors at a greedy row's next position, as far as a server's greedy token and its top
    log-probabilities decide the pick (``Sampler.pick_rule``): the token is the sampler's pick if it
    is not in ``bans``, and, where ``pooled`` names the ids whose probability a processor pools into
    one of them, not among those and more probable than all of them together (``outweighs``)."""

    bans: frozenset[int]
    pooled: frozenset[int] = frozenset()
    into: int | None = None
    """The pooled id the pool's probability goes to."""

    def picks(self, token: int) -> bool:
        """Whether ``token``, the server's greedy pick, is this sampler's, by the bans alone (no pool)."""
        return not self.pooled and token not in self.bans

    def outweighs(self, token: int, top: list[tuple[int, float]], below_top: float) -> bool:
        """Whether the server's greedy ``token`` is the sampler's pick, from the position's ``top``
        log-probabilities (best first; every other token ``below_top`` nats under the least, as the
        runners write them): allowed, the clear first of the list, and the id the pool goes to
        (which pooling only raises) or else more probable than the whole pool by a margin no float32
        rounding of the scored path bridges."""
        if token in self.bans or not top or top[0][0] != token:
            return False
        best = top[0][1]
        if len(top) > 1 and top[1][1] > best - 1e-5:  # a near tie: the scored path breaks it by id
            return False
        if token in self.pooled:
            return token == self.into
        floor = min(lp for _, lp in top) - below_top
        listed = [lp for t, lp in top if t in self.pooled]
        unlisted = len(self.pooled) - len(listed)  # each at the floor
        most = max(listed + [floor] * bool(unlisted))
        total = sum(math.exp(lp - most) for lp in listed) + unlisted * math.exp(floor - most)
        return best > most + math.log(total) + 1e-3


class Sampler:
    def __init__(self, processors: list, options: EngineOptions):
        """``processors``: the list the engine exposes; callers may insert into it later."""
        self.processors, self.opts = processors, options

    def sample(self, rows: list[Sequence], logits: torch.Tensor, at: list[int], now: float,
               picked: dict[int, int] | None = None) -> Sampled:
        """A token per row, ``rows[j]`` from the step's logits row ``at[j]`` (the step's logits stay
        untouched: a row-by-row retry starts from them). ``picked``: tokens a model server picked
        greedily that the row's rules (``pick_rule``) allow, by logits row: the processors and greedy
        would pick the same, so those rows are taken as they are and their logits rows are not read
        (per token, the processors are most of what the engine does for a row a server decodes)."""
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

    def pick_rule(self, row: Sequence) -> PickRule | None:
        """What the processors do at this row's next position, where the row picks greedily and a
        model server's greedy token can tell whether it is this sampler's pick (``PickRule``): they
        ban ids (a server that applies the bans itself, ``logit_bias``, then picks this sampler's
        token with no scores sent back), and one of them may pool some ids' probability (the newline
        rule). None where the row samples or a processor needs the scores otherwise (it forces a
        token; a processor without ``fixed_bans``, such as a caller's or the gate, cannot say)."""
        if (self.opts.temperature if row.temperature is None else row.temperature) > 0:
            return None
        bans, pooled, into = frozenset(), frozenset(), None
        for p in self.processors:
            try:
                more = p.fixed_bans(row) if hasattr(p, "fixed_bans") else None
                pool = p.pooled(row) if more is None and hasattr(p, "pooled") else None
            except Exception:  # noqa: BLE001 - the scored path runs it (and deals with its failure)
                return None
            if more is None and (pool is None or pooled):  # a second pool: not one pool any more
                return None
            if more is None:
                pooled, into = pool
                banned = bans & pooled  # the bans before the pooling take their ids out of it
                if banned:
                    pooled, into = pooled - banned, None if into in banned else into
            elif more:
                bans = bans | more
        return PickRule(bans, pooled, into)

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
