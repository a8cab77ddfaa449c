"""The step's postprocess: logits processors, sampling, marker matching and stop checks.

Processors run in order on the batch's logits (the caller's first, then gating, the hop budget,
no stop inside a query, the query cap, citations): a processor that fails on the batch runs again
row by row, and a row it still fails on ends alone (reason ``error``). A row samples greedily or
with its own generator (temperature, top-p), so it samples the same tokens in any batch. Its token
is then appended, fed to its marker matcher (a completed marker parks the row with its query) and
checked against the stop tokens, its token limit, the context and its deadline.

``Postprocess`` is a part of ``RigEngine`` (``engine/engine.py``).
"""

from __future__ import annotations

import time

import torch

from .sequence import Sequence, SequenceStatus

RUNNING, RETRIEVING = SequenceStatus.RUNNING, SequenceStatus.RETRIEVING


class Postprocess:
    def _postprocess_step(self, ready: list[int], tokens: list[int], forced: list[bool], spliced: list[bool],
                          t0: float) -> None:
        """Each row's token: its time in the trace, stops and markers; rows that completed a marker park."""
        done = time.perf_counter()
        dt_ms = (done - t0) * 1e3
        parked = []
        row_info = getattr(self.runner, "row_info", None)  # a remote runner: what the server did
        for i, tok, was_forced, was_spliced in zip(ready, tokens, forced, spliced):
            s = self.running[i]
            if s.is_finished:  # its processors failed
                continue
            try:
                info = row_info(i) if row_info is not None else None
                if was_spliced:
                    s.trace.splice_ms += dt_ms
                    s.trace.retrieval_steps[-1].splice_ms += dt_ms
                    if info is not None:
                        s.trace.retrieval_steps[-1].info["server"] = info
                elif s.num_generated:
                    s.trace.decode_ms += dt_ms
                else:
                    s.trace.ttft_ms = (done - s.arrival) * 1e3
                self._postprocess(s, tok, was_forced)
            except Exception as e:  # noqa: BLE001 - one row's bookkeeping fails that row alone
                self._fail_row(s, "postprocessing its token", e, done)
            if s.status is RETRIEVING:
                parked.append(s)
        self._park(parked, done)

    def _sample(self, rows: list[Sequence], all_logits: torch.Tensor, ready: list[int]) -> tuple[list[int], list[bool]]:
        """Sampled token per row, and whether a processor forced it (one finite logit left).
        Processors that fail on the batch run again row by row (from the same raw logits): a
        row they still fail on ends (reason ``error``), the others sample as they would have."""
        try:
            logits = self._process(rows, all_logits[ready])
        except Exception:  # noqa: BLE001 - find the row(s) it fails on
            parts = []
            for i, s in zip(ready, rows):
                try:
                    parts.append(self._process([s], all_logits[i : i + 1].clone()))
                except Exception as e:  # noqa: BLE001
                    self._fail_row(s, "applying logits processors", e, time.perf_counter())
                    parts.append(all_logits[i : i + 1])
            logits = torch.cat(parts)
        forced = (torch.isfinite(logits).sum(dim=-1) == 1).tolist()
        tokens = logits.argmax(dim=-1).tolist()
        for i, s in enumerate(rows):
            temp = self.opts.temperature if s.temperature is None else s.temperature
            if temp > 0 and not forced[i] and not s.is_finished:
                top_p = self.opts.top_p if s.top_p is None else s.top_p
                tokens[i] = sample_row(logits[i], temp, top_p, s.generator)
        return tokens, forced

    def _process(self, rows: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        for p in self.processors:
            logits = p.apply(rows, logits)
        return logits

    def _postprocess(self, s: Sequence, tok: int, forced: bool) -> None:
        now = time.perf_counter()
        s.append([tok], sampled=not forced)
        s.num_generated += 1
        s.trace.generated_tokens += 1
        if tok in self.stop_ids:
            self._finish(s, "stop", now)
            return
        for ev in s.matcher.feed(tok):
            if ev.kind == "error":
                s.trace.marker_errors.append(ev.error)
            elif s.status is RUNNING:
                s.status, s.query = RETRIEVING, ev.query
            else:
                s.trace.marker_errors.append("a second marker in the same token was ignored")
        if s.num_generated >= s.max_new_tokens:
            self._finish(s, "length", now)
        elif s.num_kept >= self.runner.context_limit:
            self._finish(s, "context_full", now)
        elif s.deadline_at is not None and now > s.deadline_at:
            self._finish(s, "deadline", now)


def sample_row(logits: torch.Tensor, temperature: float, top_p: float, generator) -> int:
    """One row's token: temperature, then nucleus (top-p) sampling with the row's own generator,
    so a row samples the same tokens whatever batch it is in."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator))


def stop_ids(model, tokenizer) -> list[int]:
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids += eos if isinstance(eos, list) else [eos]
    if not ids:
        raise ValueError("the tokenizer defines no EOS token; cannot tell when an answer ends")
    return sorted(set(ids))
