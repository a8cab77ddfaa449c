"""Peers: the systems users would pick instead of rig, on the same multi-hop work.

One workload: ``--questions`` (16) questions of the synthetic benchmark (``rig synth``; ``--dataset``
is its test.jsonl, whose folder holds corpus.jsonl), by default those whose gold answer needs at
least ``--min-hops`` (2) hops, answered by the embedded default model with its marker adapter,
greedy, hop budget ``--max-iterations`` (3), at most ``--max-tokens`` sampled tokens each, over the
real hybrid retriever built on the benchmark's corpus (as ``rig eval`` builds it), with
``--search-ms`` (150) added to every search call (a remote index). Every system gets the same
prompt token ids and runs at each ``--concurrency`` (1 and 8). Systems (``--systems``):

* ``rig-hf``           rig in process (``engine.backend: hf``): evidence spliced into the KV cache;
* ``rig-vllm-stream``  rig on vLLM in process, one resumable request per row (``engine.vllm.mode: stream``);
* ``rig-vllm-prefix``  rig on vLLM, a new request per call, vLLM's prefix cache (``mode: prefix``);
* ``rig-llama``        rig on llama-server (``engine.backend: remote``; ``--llama-server URL``);
* ``resubmit-vllm``    the string loop Search-R1 and FlashRAG run on vLLM: generate until the stop
                       string ``<|endofretrieve|>`` or EOS, decode the ids to text, parse the query,
                       search, append the evidence text (rig's evidence block, the same text), tokenise
                       the whole text again and submit it as a new request (prefix caching on); rows
                       of a batch advance in lockstep (each round waits for every row, one search call);
* ``resubmit-llama``   the same loop on llama-server's ``/completion`` with ``cache_prompt: true``.

At concurrency c, rig keeps c questions in its engine's batch (all queued at once, continuous
batching, as ``bench/engine.py`` drives it); resubmit runs batches of c rows in lockstep.

Per system: per-hop latency p50 (from the end marker to the first token after the evidence; for
rig, from the row's parking to the step that samples its first token after the splice), tokens
evaluated per hop p50 (rig-hf: the evidence block + the marker token; on vLLM and llama-server what
the engine reported: ``prompt_n`` in the hop's trace, or prompt tokens minus ``num_cached_tokens`` /
llama-server's ``timings.prompt_n``), re-tokenisation mismatches (resubmit: positions at which the
re-tokenised prompt's ids differ from the ids the model had for the same text, i.e. the previous
round's prompt plus what it generated; rig never re-tokenises: 0), end-to-end generated tokens/s
at each concurrency (all rows' generated tokens over the run's wall time), p95 request latency
(admission to last token, at the highest concurrency), and answers equal to rig-hf's (count/total,
against rig-hf at the lowest concurrency). A system whose engine is missing is reported as skipped
with the reason. stdout: a table, the ratios rig-vllm-stream vs resubmit-vllm (per hop, end to end
at the highest concurrency), then ONE JSON line last.

    python bench/peers.py [--dataset out/synth/test.jsonl] [--questions 16] [--search-ms 150]
                          [--concurrency 1,8] [--systems rig-hf,rig-vllm-stream,...] [--llama-server URL]

``rig synth --out out/synth`` writes the dataset. llama-server must serve the merged model (adapter
folded in, converted to GGUF) with ``-np`` at least the highest concurrency, ``--special`` (the
end marker is a special token: without it the server writes no text for it, so the resubmit loop's
stop string never matches and every round runs to its token limit), ``--slot-save-path DIR`` and
``--cache-ram 0`` (its slots are erased before every run, as vLLM's prefix cache is reset). On vLLM's
CPU build the KV cache gets ``--vllm-kv-gib`` (1) and ``--max-model-len`` (4096); the three vLLM
systems share one engine, its prefix cache reset before every run.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rig_decode.eval.metrics import contains_answer, percentile
from rig_decode.evidence import EvidenceFormatter, number_hits
from rig_decode.markers import MarkerMatcher, MarkerSpec, MarkerVocab

sys.path.append(str(Path(__file__).resolve().parent))  # bench/, as when run as a script (the tests load this file)
from harness import Table, emit  # noqa: E402

SYSTEMS = ("rig-hf", "rig-vllm-stream", "rig-vllm-prefix", "rig-llama", "resubmit-vllm", "resubmit-llama")
REFERENCE = "rig-hf"


def log(msg: str) -> None:
    print(f"[peers] {msg}", file=sys.stderr, flush=True)


# -- results -----------------------------------------------------------------------------------------


@dataclass
class Hop:
    question: int
    ms: float | None
    """End marker -> first token after the evidence."""
    evaluated: int | None
    """Tokens the engine evaluated to take the evidence in."""


@dataclass
class RunResult:
    system: str
    concurrency: int
    wall_s: float
    answers: list[str]
    generated: list[int]
    latency_ms: list[float]
    hops: list[Hop] = field(default_factory=list)
    retokenized: int = 0
    """Positions whose ids changed when the text was tokenised again (summed over hops)."""
    retokenized_hops: int = 0
    """Hops whose re-tokenised prompt differed anywhere from the ids the model had."""
    finish: list[str] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return sum(self.generated) / self.wall_s if self.wall_s > 0 else 0.0


class SearchDelay:
    """A retriever plus ``ms`` of simulated network time per ``search_batch`` call."""

    def __init__(self, base, ms: float):
        self.base, self.s = base, ms / 1e3
        self.calls = 0

    def search_batch(self, queries, top_k, filters=None):
        self.calls += 1
        if self.s:
            time.sleep(self.s)
        return self.base.search_batch(queries, top_k, filters)

    def __getattr__(self, name):  # docs, knows, ...
        return getattr(self.base, name)


# -- rig ---------------------------------------------------------------------------------------------


class HopClock:
    """A logits processor that changes nothing: for each row whose evidence was just prefilled,
    the time since the row parked on its end marker (the first token after the evidence is sampled
    right after the processors run). ``ms[seq_id][k]`` belongs to ``retrieval_steps[k]``."""

    def __init__(self):
        self.ms: dict[int, list[float]] = {}

    def apply(self, rows, scores):
        now = time.perf_counter()
        for s in rows:
            seen = self.ms.setdefault(s.seq_id, [])
            if len(s.trace.retrieval_steps) > len(seen) and s.parked_at:
                seen.append((now - s.parked_at) * 1e3)
        return scores


def run_rig(name: str, build_engine: Callable[[int], object], prompts: list[list[int]], concurrency: int,
            max_new_tokens: int) -> RunResult:
    """All questions queued at once; the engine (``build_engine(concurrency)``, max batch size =
    concurrency) keeps ``concurrency`` of them decoding."""
    engine = build_engine(concurrency)
    clock = HopClock()
    engine.processors.insert(0, clock)
    try:
        seqs = [engine.new_sequence(p, seq_id=i, max_new_tokens=max_new_tokens) for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        engine.generate(seqs)
        wall = time.perf_counter() - t0
    finally:
        engine.close()
    hops = []
    for s in seqs:
        for k, step in enumerate(s.trace.retrieval_steps):
            ms = clock.ms.get(s.seq_id, [])
            if k >= len(ms):  # the row finished at this marker: no token after evidence
                continue
            server = step.info.get("server")
            evaluated = server.get("prompt_n") if server else step.evidence_tokens + 1
            hops.append(Hop(s.seq_id, ms[k], evaluated))
    return RunResult(name, concurrency, wall, [s.matcher.visible_text().strip() for s in seqs],
                     [s.trace.generated_tokens for s in seqs], [s.trace.total_ms - s.trace.queue_ms for s in seqs],
                     hops, finish=[s.finish_reason or "" for s in seqs])


# -- the resubmit loop ---------------------------------------------------------------------------------


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
                log(f"resubmit-llama: {e} (retrying)")
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


# -- measuring and reporting ---------------------------------------------------------------------------


@dataclass
class System:
    name: str
    run: Callable[[list[list[int]], int, int], RunResult]
    """(prompts, concurrency, max_new_tokens) -> one measured run."""
    before_run: Callable[[], None] | None = None
    """Called before every run (the vLLM systems: reset the shared engine's prefix cache)."""


def measure(systems: list[System], prompts: list[list[int]], concurrency: list[int], max_new_tokens: int,
            warmup: int = 1, warmup_tokens: int = 8) -> tuple[dict[str, dict[int, RunResult]], dict[str, str]]:
    """Every system at every concurrency; ({name: {concurrency: run}}, {name: error})."""
    runs, errors = {}, {}
    for system in systems:
        try:
            if warmup:
                log(f"{system.name}: warm-up ({warmup} question(s), {warmup_tokens} tokens)")
                system.run(prompts[:warmup], 1, warmup_tokens)
            for c in concurrency:
                if system.before_run is not None:
                    system.before_run()
                r = system.run(prompts, c, max_new_tokens)
                runs.setdefault(system.name, {})[c] = r
                log(f"{system.name} c{c}: {len(prompts)} questions, {len(r.hops)} hops, {sum(r.generated)} tokens, "
                    f"{r.wall_s:.1f} s")
        except Exception as e:  # noqa: BLE001 - one failing system must not hide the others' figures
            errors[system.name] = f"{type(e).__name__}: {e}"
            log(f"{system.name}: error: {errors[system.name]}")
    return runs, errors


def _p(values, q=50):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return round(statistics.median(values), 1) if q == 50 else round(percentile(values, q), 1)


def summarize(runs: dict[str, dict[int, RunResult]], gold: list[list[str]] | None = None,
              reference: str = REFERENCE) -> dict[str, dict]:
    out = {}
    ref_runs = runs.get(reference) or {}
    ref = ref_runs[min(ref_runs)].answers if ref_runs else None
    for name, by_c in runs.items():
        cs = sorted(by_c)
        low, high = by_c[cs[0]], by_c[cs[-1]]
        s = {"per_hop_ms": _p([h.ms for h in low.hops]),
             "hop_tokens_evaluated": _p([h.evaluated for h in low.hops]),
             **{f"tok_s_c{c}": round(by_c[c].tok_s, 2) for c in cs},
             "p95_ms": _p(high.latency_ms, 95),
             "retokenized": low.retokenized,
             "same_answers": (f"{sum(a == b for a, b in zip(low.answers, ref))}/{len(ref)}" if ref is not None
                              else None)}
        for c in cs:
            r = by_c[c]
            s[f"per_hop_ms_c{c}"] = _p([h.ms for h in r.hops])
            s[f"p95_ms_c{c}"] = _p(r.latency_ms, 95)
            if ref is not None:
                s[f"same_answers_c{c}"] = f"{sum(a == b for a, b in zip(r.answers, ref))}/{len(ref)}"
        s["retokenized_hops"] = low.retokenized_hops
        s["hops"] = len(low.hops)
        evaluated = [h.evaluated for h in low.hops if h.evaluated is not None]
        s["hop_tokens_evaluated_mean"] = round(statistics.mean(evaluated), 1) if evaluated else None
        s["generated_tokens"] = sum(low.generated)
        if gold is not None:
            s["accuracy"] = round(statistics.mean(contains_answer(a, g) for a, g in zip(low.answers, gold)), 3)
        s["finish"] = {k: low.finish.count(k) for k in sorted(set(low.finish))}
        out[name] = s
    return out


def ratios(summary: dict[str, dict], concurrency: list[int], rig: str = "rig-vllm-stream",
           peer: str = "resubmit-vllm") -> dict:
    """How many times faster rig is than the resubmit loop: per hop (p50 at each concurrency) and end
    to end (tokens/s at the highest concurrency)."""
    a, b = summary.get(rig) or {}, summary.get(peer) or {}
    out = {}
    for c in concurrency:
        x, y = a.get(f"per_hop_ms_c{c}"), b.get(f"per_hop_ms_c{c}")
        out[f"per_hop_c{c}"] = round(y / x, 2) if x and y else None
    c = max(concurrency)
    x, y = a.get(f"tok_s_c{c}"), b.get(f"tok_s_c{c}")
    out[f"end_to_end_c{c}"] = round(x / y, 2) if x and y else None
    return out


def _fmt(v) -> str:
    return "-" if v is None else f"{v:g}" if isinstance(v, (int, float)) else str(v)


def print_report(result: dict, out=None) -> None:
    cs = result["concurrency"]
    hi = max(cs)
    print(f"{result['questions']} questions (>= {result['min_hops']} gold hops) of {result['dataset']}, "
          f"+{result['search_ms']:g} ms per search call, max_iterations {result['max_iterations']}, "
          f"{result['max_tokens']} tokens max, model {result['model']}", file=out)
    cols = ([("hop ms", "per_hop_ms")] + [(f"hop ms c{c}", f"per_hop_ms_c{c}") for c in cs if c != min(cs)]
            + [("hop eval", "hop_tokens_evaluated"), ("hops", "hops")]
            + [(f"tok/s c{c}", f"tok_s_c{c}") for c in cs]
            + [(f"p95 ms c{hi}", "p95_ms"), ("retok", "retokenized"), ("same ans", "same_answers"),
               ("acc", "accuracy")])
    table = Table(("system", "<"), *((h, _fmt) for h, _ in cols))
    for name, s in result["systems"].items():
        if "skipped" in s or "error" in s:
            table.add(name, f"{'skipped' if 'skipped' in s else 'error'}: {s.get('skipped') or s.get('error')}")
        else:
            table.add(name, *(s.get(k) for _, k in cols))
    table.print(out)
    r = result.get("ratios") or {}
    if any(v is not None for v in r.values()):
        per_hop = ", ".join(f"c{c} {_fmt(r.get(f'per_hop_c{c}'))}x" for c in cs)
        print(f"rig-vllm-stream vs resubmit-vllm: per hop {per_hop} faster; end to end at c{hi} "
              f"{_fmt(r.get(f'end_to_end_c{hi}'))}x the tokens/s", file=out)


def result_json(summary: dict, skipped: dict[str, str], errors: dict[str, str], concurrency: list[int],
                **config) -> dict:
    systems = dict(summary)
    for name, why in skipped.items():
        systems[name] = {"skipped": why}
    for name, why in errors.items():
        systems.setdefault(name, {})["error"] = why
    order = {n: i for i, n in enumerate(SYSTEMS)}
    systems = dict(sorted(systems.items(), key=lambda kv: order.get(kv[0], len(order))))
    return {"bench": "peers", **config, "concurrency": concurrency, "systems": systems,
            "ratios": ratios(summary, concurrency)}


# -- building the real systems -------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="out/synth/test.jsonl", help="a rig synth test.jsonl (corpus.jsonl beside it)")
    p.add_argument("--questions", "--limit", dest="questions", type=int, default=16)
    p.add_argument("--min-hops", type=int, default=2,
                   help="only questions whose gold answer needs at least this many hops (0: all)")
    p.add_argument("--search-ms", type=float, default=150.0, help="added to every search call")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--systems", help=f"comma-separated, of {','.join(SYSTEMS)} (default: every one available)")
    p.add_argument("--llama-server",
                   help="URL of a running llama-server serving the merged model (rig-llama, resubmit-llama)")
    p.add_argument("--config", help="YAML config (default: the embedded model with its marker adapter)")
    p.add_argument("--max-iterations", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128, help="sampled tokens per answer (evidence not counted)")
    p.add_argument("--max-model-len", type=int, default=4096, help="vLLM's max_model_len")
    p.add_argument("--vllm-kv-gib", type=float, help="vLLM's KV cache in GiB (default: 1 on vLLM's CPU build)")
    p.add_argument("--warmup", type=int, default=1,
                   help="questions each system answers (8 tokens) before it is measured")
    return p.parse_args(argv)


def _vllm_engine(cfg, api):
    from rig_decode.engine.runner_vllm import EventLoopThread
    from rig_decode.engine.vllm_api import engine_args_kwargs

    args = api.AsyncEngineArgs(**engine_args_kwargs(cfg, api))
    loop = EventLoopThread("peers-vllm")

    async def start():  # on the loop thread: AsyncLLM binds its output handler to the running loop
        return api.AsyncLLM.from_engine_args(args)

    try:
        return loop, loop.run(start())
    except BaseException:
        loop.close()
        raise


def _vllm_systems(vcfg, api, names, tokenizer, retriever, rig_system, loop_kw):
    """The vLLM systems of ``names`` on one shared ``AsyncLLM``, and the function that shuts it down.
    Only ``held`` refers to the engine, so that shutting down can drop it: ``AsyncLLM.__del__``
    then runs now, not at interpreter exit (where vLLM's module globals are gone)."""
    import gc

    from rig_decode.engine.runner_vllm import VllmRunner

    loop, engine = _vllm_engine(vcfg, api)
    held = {"engine": engine}
    del engine
    v = vcfg.engine.vllm
    reset = _reset_prefix_cache(held, loop)
    systems, completers = [], []
    for n in names:
        if n == "resubmit-vllm":
            complete = VllmCompleter(held["engine"], api, loop)
            completers.append(complete)
            systems.append(System(n, lambda p, c, k, complete=complete: run_resubmit(
                "resubmit-vllm", complete, tokenizer, retriever, p, c, k, context_limit=v.max_model_len, **loop_kw),
                reset))
        else:
            mode = n.rsplit("-", 1)[1]
            systems.append(rig_system(n, lambda c, mode=mode: VllmRunner(
                held["engine"], api, len(tokenizer), mode=mode, top_logprobs=v.top_logprobs, lookahead=v.lookahead,
                context_limit=v.max_model_len, loop=loop, owns_loop=False), vcfg, None, reset))

    def stop():
        async def shutdown(engine):
            engine.shutdown(timeout=30)

        try:
            loop.run(shutdown(held["engine"]), timeout=120)
        finally:
            held.clear()
            for c in completers:
                c.engine = None
            gc.collect()
            loop.close()

    return systems, stop


def _reset_prefix_cache(held: dict, loop):
    def reset():
        fn = getattr(held.get("engine"), "reset_prefix_cache", None)
        if fn is None:
            return

        async def call():
            r = fn()
            return await r if inspect.isawaitable(r) else r

        try:
            loop.run(call(), timeout=60)
        except Exception as e:  # noqa: BLE001 - a cache that stays warm is reported, not fatal
            log(f"could not reset vLLM's prefix cache: {type(e).__name__}: {e}")

    return reset


def _erase_llama_slots(base_url: str):
    """llama-server's counterpart of resetting vLLM's prefix cache: erase every slot's KV before a run,
    so no system starts on prompts an earlier one left there. The server needs ``--slot-save-path``
    for the erase action and ``--cache-ram 0`` so that no prompt comes back from its host-memory
    cache; without them the run goes on and the log says the cache stays warm."""
    from rig_decode.engine.runner_remote import HttpServer, RemoteError

    def erase():
        server = HttpServer(base_url)
        try:
            slots = server.get("/slots")
            if not slots:
                log("llama-server lists no slots (/slots): its cache stays warm between runs")
            for slot in slots or []:
                server.post(f"/slots/{slot['id']}?action=erase", {})
        except RemoteError as e:
            log(f"llama-server's slots were not erased ({e}): start it with --slot-save-path DIR --cache-ram 0")
        finally:
            server.close()

    return erase


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the table and the JSON line
    concurrency = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    wanted = [s.strip() for s in (args.systems or ",".join(SYSTEMS)).split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SYSTEMS]
    if unknown or not concurrency or min(concurrency) < 1:
        print(f"bench/peers.py: unknown system(s) {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}"
              if unknown else "bench/peers.py: --concurrency needs positive integers", file=sys.stderr)
        return 2

    from rig_decode.config import RigConfig
    from rig_decode.eval.datasets import DatasetError, load_dataset
    from rig_decode.prompt import build_prompt
    from rig_decode.retrieval.factory import build_retriever

    try:
        examples, corpus = load_dataset(args.dataset)
    except DatasetError as e:
        print(f"bench/peers.py: {e} (write the synthetic benchmark with: rig synth --out out/synth)", file=sys.stderr)
        return 2
    examples = [e for e in examples if (e.hops or 0) >= args.min_hops][: args.questions]
    if not examples:
        print(f"bench/peers.py: no question of {args.dataset} needs {args.min_hops} hops", file=sys.stderr)
        return 2
    base = RigConfig.from_yaml(args.config) if args.config else RigConfig()
    cfg = base.updated(rig={"max_iterations": args.max_iterations}, model={"max_tokens": args.max_tokens},
                       engine={"backend": "hf"})
    log(f"{len(examples)} questions; building the retriever over "
        f"{len(corpus) if corpus else 'the configured'} documents")
    retriever = SearchDelay(build_retriever(cfg.retriever, corpus=corpus), args.search_ms)

    model = tokenizer = None
    if "rig-hf" in wanted:
        from rig_decode.models.loader import load_model

        log(f"loading {cfg.model.name} in process")
        model, tokenizer = load_model(cfg.model)
    else:
        from rig_decode.models.loader import load_tokenizer

        tokenizer = load_tokenizer(cfg.model)
    spec = MarkerSpec.from_style(cfg.rig.marker_style)
    prompts = [build_prompt(tokenizer, e.question, spec, cfg.system_prompt()) for e in examples]

    from rig_decode.engine import RigEngine
    from rig_decode.session import engine_options

    systems, skipped, cleanup = [], {}, []

    def rig_system(name, make_runner, opts_cfg, the_model=None, before=None):
        def build(c):
            runner = make_runner(c) if make_runner else None
            return RigEngine(the_model, tokenizer, retriever, engine_options(opts_cfg, the_model, max_batch_size=c),
                             runner=runner)

        return System(name, lambda p, c, n: run_rig(name, build, p, c, n), before)

    loop_kw = dict(max_iterations=cfg.rig.max_iterations, top_k=cfg.retriever.top_k,
                   evidence_budget=cfg.rig.evidence_token_budget, spec=spec)

    if "rig-hf" in wanted:
        systems.append(rig_system("rig-hf", None, cfg, model))

    vllm_names = [n for n in ("rig-vllm-stream", "rig-vllm-prefix", "resubmit-vllm") if n in wanted]
    if vllm_names:
        from rig_decode.engine.vllm_api import VllmMissingError, load_vllm_api

        try:
            api = load_vllm_api()
        except VllmMissingError as e:
            api = None
            for n in vllm_names:
                skipped[n] = f"vLLM missing: {e}"
        if api is not None:
            kv = args.vllm_kv_gib if args.vllm_kv_gib is not None else (1.0 if api.device == "cpu" else None)
            vcfg = cfg.updated(engine={"backend": "vllm", "vllm": {"max_model_len": args.max_model_len,
                                                                   "kv_cache_gib": kv}})
            if "rig-vllm-stream" in vllm_names and api.StreamingInput is None:
                skipped["rig-vllm-stream"] = f"vLLM {api.version} has no StreamingInput (resumable requests)"
                vllm_names.remove("rig-vllm-stream")
            if vllm_names:
                log(f"starting vLLM {api.version} ({api.device}) with {vcfg.model.name}")
                try:
                    built, stop_vllm = _vllm_systems(vcfg, api, vllm_names, tokenizer, retriever, rig_system, loop_kw)
                    systems += built
                    cleanup.append(stop_vllm)
                except Exception as e:  # noqa: BLE001 - reported as skipped, the other systems still run
                    for n in vllm_names:
                        skipped[n] = f"vLLM engine did not start: {type(e).__name__}: {e}"

    llama_names = [n for n in ("rig-llama", "resubmit-llama") if n in wanted]
    for n in llama_names:
        if not args.llama_server:
            skipped[n] = "no --llama-server URL"
    if llama_names and args.llama_server:
        from rig_decode.engine.runner_remote import LlamaCppServer, RemoteRunner

        probe = LlamaCppServer(args.llama_server)
        props = probe.get("/props")
        n_ctx = probe.context_limit()
        probe.close()
        if props is None:
            for n in llama_names:
                skipped[n] = f"no llama-server answers {args.llama_server}/props"
        else:
            rcfg = cfg.updated(engine={"backend": "remote",
                                       "remote": {"base_url": args.llama_server, "api": "llama.cpp"}})
            r = rcfg.engine.remote
            erase = _erase_llama_slots(args.llama_server)
            if "rig-llama" in llama_names:
                systems.append(rig_system("rig-llama", lambda c: RemoteRunner(
                    LlamaCppServer(args.llama_server), len(tokenizer), lookahead=r.lookahead,
                    top_logprobs=r.top_logprobs, parallel=max(c, r.parallel)), rcfg, before=erase))
            if "resubmit-llama" in llama_names:
                complete = LlamaCompleter(args.llama_server, parallel=max(concurrency))
                cleanup.append(complete.close)
                systems.append(System("resubmit-llama", lambda p, c, k: run_resubmit(
                    "resubmit-llama", complete, tokenizer, retriever, p, c, k,
                    context_limit=n_ctx or args.max_model_len, **loop_kw), erase))

    for n in wanted:
        if n not in skipped and n not in {s.name for s in systems}:
            skipped[n] = "not built"
    for n, why in skipped.items():
        log(f"{n}: skipped: {why}")
    try:
        runs, errors = measure(systems, prompts, concurrency, args.max_tokens, warmup=args.warmup)
    finally:
        for fn in cleanup:
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                log(f"cleanup: {type(e).__name__}: {e}")
    summary = summarize(runs, [e.answers for e in examples])
    adapter = cfg.model.adapter
    result = result_json(summary, skipped, errors, concurrency, dataset=str(args.dataset), questions=len(examples),
                         min_hops=args.min_hops, search_ms=args.search_ms, max_iterations=cfg.rig.max_iterations,
                         max_tokens=args.max_tokens,
                         model=f"{cfg.model.name} (adapter: {adapter})",
                         search_calls=retriever.calls)
    print_report(result)
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
