"""The step's postprocess: each row's sampled token is appended, timed, fed to the row's marker
matcher (a completed marker parks the row with its query) and checked against the stop tokens,
the request's stop strings (in its answer text), the row's token limit, the context and its
deadline. It returns the rows that parked; the hop handler takes them from there.
"""

from __future__ import annotations

import time

from .sampling import Sampled
from .sequence import Sequence, SequenceStatus

RUNNING, RETRIEVING = SequenceStatus.RUNNING, SequenceStatus.RETRIEVING


def postprocess(rows: list[Sequence], sampled: Sampled, spliced: list[bool], started: list[float],
                stop_ids: list[int], context_limit: int, row_info=None, runner_rows: list[int] = ()) -> list[Sequence]:
    """Each row's token. ``started[j]``: when ``rows[j]``'s tokens went to the runner (its step's
    time runs from there); ``row_info(runner_rows[j])``: what a remote server did for ``rows[j]``'s
    step, where the runner says. A failure in one row's bookkeeping fails that row alone. Returns
    the rows that parked (``parked_at``: when their marker completed)."""
    done = time.perf_counter()
    parked = []
    for j, (s, tok, forced, was_spliced) in enumerate(zip(rows, sampled.tokens, sampled.forced, spliced)):
        if s.is_finished:  # its processors failed
            continue
        try:
            info = row_info(runner_rows[j]) if row_info is not None else None
            _account_time(s, was_spliced, (done - started[j]) * 1e3, done, info)
            _take_token(s, tok, forced, stop_ids, context_limit)
        except Exception as e:  # noqa: BLE001
            s.fail("postprocessing its token", e, done)
        if s.status is RETRIEVING:
            parked.append(s)
    return parked


def _account_time(s: Sequence, was_spliced: bool, dt_ms: float, done: float, server_info: dict | None) -> None:
    if was_spliced:
        step = s.trace.retrieval_steps[-1]
        s.trace.splice_ms += dt_ms
        step.splice_ms += dt_ms
        step.first_token_ms = (done - s.parked_at) * 1e3
        if server_info is not None:
            step.info["server"] = server_info
    elif s.num_generated:
        s.trace.decode_ms += dt_ms
    else:
        s.trace.ttft_ms = (done - s.arrival) * 1e3


def _take_token(s: Sequence, tok: int, forced: bool, stop_ids: list[int], context_limit: int) -> None:
    now = time.perf_counter()
    s.append([tok], sampled=not forced)
    s.num_generated += 1
    s.trace.generated_tokens += 1
    if tok in stop_ids:
        s.finish("stop", now)
        return
    for ev in s.matcher.feed(tok):
        if ev.kind == "error":
            s.trace.marker_errors.append(ev.error)
        elif s.status is RUNNING:
            s.status, s.query, s.parked_at = RETRIEVING, ev.query, now
        else:
            s.trace.marker_errors.append("a second marker in the same token was ignored")
    if s.answer is not None and s.answer.stop:
        s.advance_answer()
    if s.hit_stop_string:
        s.finish("stop", now)
    elif s.num_generated >= s.max_new_tokens:
        s.finish("length", now)
    elif s.num_kept >= context_limit:
        s.finish("context_full", now)
    elif s.deadline_at is not None and now > s.deadline_at:
        s.finish("deadline", now)


def stop_ids(model, tokenizer) -> list[int]:
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids += eos if isinstance(eos, list) else [eos]
    if not ids:
        raise ValueError("the tokenizer defines no EOS token; cannot tell when an answer ends")
    return sorted(set(ids))
