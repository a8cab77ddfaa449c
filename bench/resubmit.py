"""The string-resubmit loop Search-R1 and FlashRAG run, and its two clients (vLLM's ``AsyncLLM``,
llama-server's ``/completion``): the peer ``bench/peers.py`` measures rig against.

Each round generates until the stop string (the end marker) or EOS, decodes the ids to text, parses
the query, searches, appends the evidence text (rig's evidence block, the same text), tokenises the
whole text again and submits it as a new request (prefix caching on). Rows of a batch advance in
lockstep: each round waits for every row, one search call. Re-tokenising is where the loop loses
the ids the model had: ``retokenization_mismatches`` counts the positions that changed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from rig_decode.evidence import EvidenceFormatter, number_hits
from rig_decode.markers import MarkerMatcher, MarkerSpec, MarkerVocab

sys.path.append(str(Path(__file__).resolve().parent))  # bench/, as when run as a script (the tests load this file)
from peers_report import Hop, RunResult  # noqa: E402


@dataclass
class Segment:
    """One request of the resubmit loop: what it generated and when."""

    ids: list[int]
    t_sent: float
    t_first: float
    t_end: float
    evaluated: int | None = None
    stopped_on_string: bool = False
    """The server said it stopped on the stop string (which it may have left out of ``ids``)."""


@dataclass
class _Row:
    index: int
    ids: list[int]
    text: str
    remaining: int
    gen: list[int] = field(default_factory=list)
    hops: int = 0
    known: dict[str, int] = field(default_factory=dict)
    marker_at: float | None = None
    done: bool = False
    finish: str = ""
    t_start: float = 0.0
    t_done: float = 0.0


def retokenization_mismatches(had: list[int], new: list[int]) -> int:
    """Positions of ``had`` (the ids the model had for a text) whose id the re-tokenised ``new``
    (ids of that text plus more) does not repeat: a changed id, and every id shifted after it."""
    return sum(1 for i, t in enumerate(had) if i >= len(new) or new[i] != t)


def cut_at(tokenizer, ids: list[int], stop: str) -> tuple[list[int], bool]:
    """``ids`` up to the token that completes ``stop`` in their decoded text, and whether it occurs."""
    def has(k):
        return stop in tokenizer.decode(ids[:k], skip_special_tokens=False)

    if not ids or not has(len(ids)):
        return ids, False
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if has(mid):
            hi = mid
        else:
            lo = mid + 1
    return ids[:lo], True


def _stop_ids(tokenizer, extra=()) -> set[int]:
    ids = set(extra)
    eos = tokenizer.eos_token_id
    if eos is not None:
        ids |= set(eos) if isinstance(eos, list) else {eos}
    return ids


def run_resubmit(name: str, complete, tokenizer, retriever, prompts: list[list[int]], concurrency: int,
                 max_new_tokens: int, *, max_iterations: int, top_k: int, evidence_budget: int,
                 context_limit: int, spec: MarkerSpec | None = None, stop_ids=()) -> RunResult:
    """The string-resubmit loop. ``complete(prompts, max_tokens, stops) -> [Segment]`` runs one round
    of requests (token-id prompts, each its own max tokens and stop string or None) concurrently."""
    spec = spec or MarkerSpec.special_token()
    start, end = spec.start[0], spec.end[0]
    formatter = EvidenceFormatter(tokenizer, evidence_budget)
    vocab = MarkerVocab(tokenizer, spec)
    stops = _stop_ids(tokenizer, stop_ids)
    rows = [_Row(i, list(p), tokenizer.decode(p, skip_special_tokens=False), max_new_tokens)
            for i, p in enumerate(prompts)]
    hops: list[Hop] = []
    retok = retok_hops = 0
    t0 = time.perf_counter()
    for b in range(0, len(rows), concurrency):
        batch = rows[b : b + concurrency]
        for r in batch:
            r.t_start = time.perf_counter()
        active = batch
        while active:
            stop = [end if r.hops < max_iterations else None for r in active]
            room = [min(r.remaining, context_limit - len(r.ids) - 1) for r in active]
            asked = [(r, s, n) for r, s, n in zip(active, stop, room) if n > 0]
            for r, _, n in zip(active, stop, room):
                if n <= 0:
                    r.done, r.t_done = True, time.perf_counter()
                    r.finish = "context_full" if r.remaining > 0 else "length"
            segs = (complete([r.ids for r, _, _ in asked], [n for *_, n in asked], [s for _, s, _ in asked])
                    if asked else [])
            searching = []
            for (r, s, _), seg in zip(asked, segs):
                if r.marker_at is not None:
                    hops.append(Hop(r.index, (seg.t_first - r.marker_at) * 1e3, seg.evaluated))
                    r.marker_at = None
                ids, marked = cut_at(tokenizer, seg.ids, s) if s else (seg.ids, False)
                if s and not marked and seg.stopped_on_string:  # the server left the stop string out
                    ids, marked = ids + tokenizer.encode(s, add_special_tokens=False), True
                had = r.ids + ids
                piece = tokenizer.decode(ids, skip_special_tokens=False)
                r.gen += ids
                r.remaining -= len(ids)
                r.text += piece
                r.ids = had
                if not marked or start not in piece:
                    r.done, r.t_done = True, seg.t_end
                    r.finish = "stop" if (ids and ids[-1] in stops) or marked else "length"
                elif r.remaining <= 0:
                    r.done, r.finish, r.t_done = True, "length", seg.t_end
                else:
                    raw = piece[piece.rfind(start) + len(start) : piece.rfind(end)]
                    searching.append((r, spec.decode_query(raw), seg.t_end))
            if searching:
                queries = [q for _, q, _ in searching if q]
                found = iter(retriever.search_batch(queries, top_k) if queries else [])
                for r, q, t_marker in searching:
                    hits = list(next(found)) if q else []
                    numbers = number_hits(hits, r.known)
                    try:
                        block = formatter.render_block(hits, r.hops + 1, budget=context_limit - len(r.ids) - 1,
                                                       numbers=numbers)
                    except ValueError:
                        r.done, r.finish, r.t_done = True, "context_full", time.perf_counter()
                        continue
                    for h, n in zip(hits, numbers):
                        if h.doc_id in block.doc_ids:
                            r.known.setdefault(h.doc_id, n)
                    r.text += tokenizer.decode(block.token_ids, skip_special_tokens=False)
                    new = tokenizer.encode(r.text, add_special_tokens=False)
                    bad = retokenization_mismatches(r.ids, new)
                    retok += bad
                    retok_hops += bad > 0
                    r.ids, r.hops, r.marker_at = new, r.hops + 1, t_marker
            active = [r for r in active if not r.done]
    wall = time.perf_counter() - t0
    answers = []
    for r in rows:
        matcher = MarkerMatcher(vocab)
        for t in r.gen:
            if t not in stops:
                matcher.feed(t)
        answers.append(matcher.visible_text().strip())
    return RunResult(name, concurrency, wall, answers, [len(r.gen) for r in rows],
                     [(r.t_done - r.t_start) * 1e3 for r in rows], hops, retok, retok_hops, [r.finish for r in rows])


class VllmCompleter:
    """One resubmit round on an ``AsyncLLM``: a new request per row, all in flight together."""

    def __init__(self, engine, api, loop):
        self.engine, self.api, self.loop = engine, api, loop

    async def _one(self, ids, max_tokens, stop) -> Segment:
        params = self.api.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=[stop] if stop else None,
                                         include_stop_str_in_output=bool(stop), skip_special_tokens=False,
                                         output_kind=self.api.RequestOutputKind.DELTA)
        t0, first, out, final = time.perf_counter(), None, [], None
        async for o in self.engine.generate(self.api.TokensPrompt(prompt_token_ids=list(ids)), params,
                                            f"peers-{uuid.uuid4().hex}"):
            first = first or time.perf_counter()
            out += o.outputs[0].token_ids
            final = o
        cached = getattr(final, "num_cached_tokens", None)
        return Segment(out, t0, first or time.perf_counter(), time.perf_counter(),
                       None if cached is None else len(ids) - cached,
                       bool(stop) and final is not None and final.outputs[0].stop_reason == stop)

    def __call__(self, prompts, max_tokens, stops) -> list[Segment]:
        async def all_rows():
            return await asyncio.gather(*(self._one(p, n, s) for p, n, s in zip(prompts, max_tokens, stops)))

        return self.loop.run(all_rows())


class LlamaCompleter:
    """One resubmit round on llama-server's ``/completion`` (``cache_prompt``), one call per row in
    parallel. The prompt goes as token ids, tokenised here with the model's tokenizer (what the
    server's own tokenizer gives for the same text, where the GGUF carries the same vocabulary)."""

    def __init__(self, base_url: str, parallel: int = 8, timeout_s: float = 600.0):
        import httpx

        self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s)
        self.pool = ThreadPoolExecutor(max(1, parallel))

    def _one(self, ids, max_tokens, stop, retries: int = 2) -> Segment:
        """One request. A connection the server closes before answering anything (it happens on the
        first request of a fresh client after vLLM's engine has started in this process; nothing
        reached the server's slots) is opened again, at most ``retries`` times, and logged."""
        import httpx

        for _ in range(retries):
            try:
                return self._request(ids, max_tokens, stop)
            except httpx.RemoteProtocolError as e:
                print(f"[peers] resubmit-llama: {e} (retrying)", file=sys.stderr, flush=True)
        return self._request(ids, max_tokens, stop)

    def _request(self, ids, max_tokens, stop) -> Segment:
        body = {"prompt": list(ids), "n_predict": max_tokens, "temperature": 0.0, "seed": 0, "cache_prompt": True,
                "return_tokens": True, "repeat_penalty": 1.0, "stream": True, "stop": [stop] if stop else []}
        t0, first, out, last = time.perf_counter(), None, [], {}
        with self.http.stream("POST", "/completion", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"llama-server /completion answered {r.status_code}: {r.read()[:300]!r}")
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("tokens"):
                        first = first or time.perf_counter()
                        out += chunk["tokens"]
                    last = chunk
            else:  # a server that answers in one piece: the first token comes with the rest
                last = json.loads(r.read())
                first = time.perf_counter()
                out = list(last.get("tokens") or [])
        timings = last.get("timings") or {}
        by_string = bool(stop) and (last.get("stop_type") == "word" or last.get("stopping_word") == stop)
        return Segment(out, t0, first or time.perf_counter(), time.perf_counter(), timings.get("prompt_n"), by_string)

    def __call__(self, prompts, max_tokens, stops) -> list[Segment]:
        return list(self.pool.map(self._one, prompts, max_tokens, stops))

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.http.close()
