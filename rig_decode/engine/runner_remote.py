"""A model runner backed by a completion server (llama.cpp's ``llama-server``, vLLM's OpenAI server).

The engine drives every backend through the same runner interface: ``add_rows`` / ``step`` (feed
each row its new tokens, get next-token logits) / ``select``. This runner answers ``step`` from a
remote server without ever sending text:

* each request carries the row's **token ids** (prompt, sampled tokens, evidence) as the prompt,
  so nothing is re-tokenised and the server's prefix cache holds everything but the new tokens;
* the server predicts ``lookahead`` tokens greedily and returns, for each, its top ``top_logprobs``
  log-probabilities. A step is served from that lookahead as long as the engine picks the token
  the server predicted; the row's next-token "logits" are the top log-probabilities, every other
  token set far below them. The engine's logits processors (hop budget, query cap, newline rule,
  citations, gate) and sampling then run unchanged, and whenever they pick another token (a
  banned marker, a forced delimiter, a spliced evidence block) the lookahead is dropped and the
  next step asks the server again from the new token list - one round trip per hop, not per token.

Greedy decoding through this runner picks the same tokens as the server's model would under the
engine's masks, except where a mask bans every one of the top tokens (then the best unlisted token
is unknown; raise ``top_logprobs``). Sampling at temperature > 0 draws from the top tokens only.

After each call the runner keeps what the server said about the prompt: how many tokens it took
from its cache and how many it evaluated, and whether its view of the prompt differs from the ids
sent (a server that re-tokenised). The engine puts these into the trace of the hop they follow.
"""


from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from .servers import Completion, RemoteError

BELOW_TOP = 30.0
"""Where a position's scores come as its top log-probabilities, every other token is written this
many nats below the least of them (finite, so that a single allowed token still reads as forced)."""


@dataclass(slots=True)
class RemoteRow:
    tokens: list[int] = field(default_factory=list)
    ahead: deque = field(default_factory=deque)
    """Predictions for the positions after ``tokens``, best guess of what comes next."""
    info: dict | None = None
    """What the server said about the prompt of this row's last call (until ``row_info`` takes it)."""


class RemoteRunner:
    """The engine's runner interface over a completion server (see the module docstring)."""

    def __init__(self, server, vocab_size: int, *, lookahead: int = 16, top_logprobs: int = 20,
                 parallel: int = 1, context_limit: int | None = None):
        if lookahead < 1 or top_logprobs < 1 or parallel < 1:
            raise ValueError("lookahead, top_logprobs and parallel must be at least 1")
        self.server, self.vocab_size = server, vocab_size
        self.lookahead, self.top_logprobs = lookahead, top_logprobs
        self.pool = ThreadPoolExecutor(parallel) if parallel > 1 else None
        self._limit = context_limit or server.context_limit() or 1 << 30
        self.rows: list[RemoteRow] = []
        self.calls = 0

    @property
    def context_limit(self) -> int:
        return self._limit

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def _new_row(self) -> RemoteRow:
        return RemoteRow()

    def reset(self, batch_size: int = 0) -> None:
        self.rows = [self._new_row() for _ in range(batch_size)]

    def add_rows(self, prompts: list[list[int]], share_prefix: bool = True) -> list[list[int]]:
        """New rows start empty and feed their whole prompt (the server's cache holds any prefix)."""
        self.rows += [self._new_row() for _ in prompts]
        return [list(p) for p in prompts]

    def select(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]

    def compact(self, force: bool = False) -> None:
        pass

    def row_info(self, i: int) -> dict | None:
        info, self.rows[i].info = self.rows[i].info, None
        return info

    def step(self, feeds: list[list[int]]) -> torch.Tensor:
        """Append each row's tokens; log-probability rows for what comes next (zeros for rows that
        fed nothing). Rows whose lookahead no longer matches go to the server, together."""
        assert len(feeds) == len(self.rows), "rows must match the batch"
        if not any(feeds):
            raise ValueError("no row has anything to feed")
        ask = []
        for i, (row, feed) in enumerate(zip(self.rows, feeds)):
            if not feed:
                continue
            if row.ahead and len(feed) == 1 and feed[0] == row.ahead[0].token:
                row.ahead.popleft()
            else:
                row.ahead.clear()
            row.tokens += feed
            if not row.ahead:
                ask.append(i)
        if ask:
            self._ask(ask)
        logits = self._new_logits(feeds)
        for i, (row, feed) in enumerate(zip(self.rows, feeds)):
            if feed:
                self._write_scores(logits[i], row.ahead[0].top)
        return logits

    def _ask(self, ask: list[int]) -> None:
        """Ask the server what comes next for these rows (their lookahead is used up)."""
        calls = [self.rows[i].tokens for i in ask]
        done = list(self.pool.map(self._complete, calls)) if self.pool else [self._complete(t) for t in calls]
        self._take(ask, done)

    def _take(self, ask: list[int], done: list[tuple[Completion, dict]]) -> None:
        for i, (completion, info) in zip(ask, done):
            self.rows[i].ahead = deque(completion.predictions)
            self.rows[i].info = info

    def _predict_n(self, tokens: list[int]) -> int:
        return max(1, min(self.lookahead, self._limit - len(tokens)))

    def _complete(self, tokens: list[int]) -> tuple[Completion, dict]:
        completion = self.server.complete(list(tokens), self._predict_n(tokens), self.top_logprobs)
        return completion, self._accept(tokens, completion)

    def _accept(self, tokens: list[int], completion: Completion) -> dict:
        """Count the call, check it, and say what the server did with the prompt."""
        self.calls += 1
        if not completion.predictions:
            raise RemoteError("the server returned no tokens (context full on the server side?)")
        info = {"cache_n": completion.cache_n, "prompt_n": completion.prompt_n}
        if completion.prompt_ms is not None:
            info["prompt_ms"] = completion.prompt_ms
        if completion.prompt_ids is not None and list(completion.prompt_ids) != list(tokens):
            info["retokenized"] = True
        return info

    def _new_logits(self, feeds: list[list[int]]) -> torch.Tensor:
        """The step's logits before the fed rows are written (rows that fed nothing: zeros). Written
        through numpy: a few rows of memory writes, which torch would spread over OpenMP's threads,
        whose wake-ups cost more than the writes and take the cores a server on this machine runs on."""
        logits = np.empty((len(feeds), self.vocab_size), dtype=np.float32)
        for i, feed in enumerate(feeds):
            if not feed:
                logits[i] = 0.0
        return torch.from_numpy(logits)

    def _check_ids(self, ids) -> None:
        """A token id the local tokenizer does not have: the server's error."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RemoteError(f"the server returned token id {bad[0]}; the local tokenizer has "
                              f"{self.vocab_size} tokens: is it serving the same model?")

    def _write_scores(self, row: torch.Tensor, top: list[tuple[int, float]]) -> None:
        """The top log-probabilities into ``row`` (a row of ``_new_logits``), every other token
        ``BELOW_TOP`` nats below the least of them."""
        ids, vals = zip(*top)
        self._check_ids(ids)
        out = row.numpy()
        out.fill(min(vals) - BELOW_TOP)
        out[list(ids)] = vals

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False)
        self.server.close()
