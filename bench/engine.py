"""Serving throughput: continuous batching with retrieval off the decode path.

A mixed workload of ``--requests`` questions over the demo knowledge base: request i is made to
hop i % 4 times (0 to 3), its markers placed at fixed steps shifted by a per-request offset (rows
pause at different steps, as independent requests do) and no others (the model's own marker
openings and its end of text are masked: every request writes exactly ``--max-new-tokens``); the
rest is the model's own greedy decoding, and a row computes the same tokens in any batch, so every
concurrency level does exactly the same work. All requests are queued at once; the
engine keeps at most ``concurrency`` of them in the batch. Retrieval is the real hybrid search over
the demo index, plus ``--retrieval-latency-ms`` of simulated network time (a remote index or
reranker), once per search call.

For each concurrency: aggregate generated tokens per second, p50/p95 request latency, mean time a
request spent parked waiting for evidence. Then the same workload at concurrency 8 with retrieval
forced onto the decode path (``sync_retrieval``): every search stalls the whole batch.

    python bench/engine.py [--requests 16] [--concurrency 1,4,8,16] [--retrieval-latency-ms 150]
                           [--repeat 1] [--plot PNG]

Prints a table, then one JSON line; ``--plot`` also draws tokens/s and request latency against
concurrency. ``--repeat N`` runs every configuration N times, round-robin, and reports each one's
median run (a 2-core machine shared with others drifts by 10-20% over minutes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from rig_decode.config import ModelConfig, RetrieverConfig
from rig_decode.engine import EngineOptions, RigEngine
from rig_decode.gate import opening_ids
from rig_decode.markers import MarkerSpec, MarkerVocab
from rig_decode.models.loader import load_model
from rig_decode.prompt import build_prompt
from rig_decode.retrieval.factory import build_retriever
from harness import Table, emit  # bench/ is on sys.path when run as a script
from workload import QUESTIONS

QUERIES = ["error E1234 fixed in release", "release 4.2.1 approved by", "Priya Raman office"]
HOP_STEPS = (2, 26, 50)


def hop_step(seq_id: int, hop: int) -> int:
    """The step at which request ``seq_id`` starts writing its ``hop``-th marker."""
    return HOP_STEPS[hop] + (seq_id * 5) % 16


class ForcedHops:
    """Writes request i's markers (i % 4 of them) at fixed steps and no other markers, and keeps
    every request going to its token limit; everything else is the model's."""

    def __init__(self, vocab: MarkerVocab, hops: dict[int, int], stop_ids: list[int]):
        self.hops, self.stop_ids = hops, stop_ids
        self.ids = [vocab.marker_token_ids(q) for q in QUERIES]
        self.opening = opening_ids(vocab)

    def apply(self, rows, scores):
        for i, seq in enumerate(rows):
            scores[i, self.stop_ids] = float("-inf")
            if not seq.matcher.is_open:
                scores[i, self.opening] = float("-inf")  # unscripted markers; the scripted ones are forced below
            for h in range(self.hops.get(seq.seq_id, 0)):
                k = seq.num_generated - hop_step(seq.seq_id, h)
                if 0 <= k < len(self.ids[h]):
                    scores[i].fill_(float("-inf"))
                    scores[i, self.ids[h][k]] = 0.0
        return scores


class Latency:
    def __init__(self, base, ms: float):
        self.base, self.s = base, ms / 1e3

    def search_batch(self, queries, top_k, filters=None):
        time.sleep(self.s)
        return self.base.search_batch(queries, top_k, filters)


def run(model, tok, retriever, n_requests: int, concurrency: int, max_new: int, sync: bool) -> dict:
    vocab = MarkerVocab(tok, MarkerSpec.special_token())
    hops = {i: i % 4 for i in range(n_requests)}
    opts = EngineOptions(max_iterations=6, max_new_tokens=max_new, evidence_token_budget=128, top_k=2,
                         max_batch_size=concurrency, sync_retrieval=sync, retrieval_timeout_s=30)
    engine = RigEngine(model, tok, retriever, opts, vocab=vocab)
    engine.processors.insert(0, ForcedHops(vocab, hops, engine.stop_ids))
    spec = MarkerSpec.special_token()
    seqs = [engine.new_sequence(build_prompt(tok, QUESTIONS[i % len(QUESTIONS)], spec), seq_id=i)
            for i in range(n_requests)]
    t0 = time.perf_counter()
    for s in seqs:
        engine.add(s)
    while engine.has_unfinished:
        engine.step()
    wall = time.perf_counter() - t0
    engine.close()
    lat = [s.trace.total_ms for s in seqs]
    tokens = sum(s.trace.generated_tokens for s in seqs)
    assert all(s.trace.num_hops == hops[s.seq_id] for s in seqs), "a request hopped more or less than scripted"
    assert tokens == n_requests * max_new, "a request stopped before its token limit"
    return {"concurrency": concurrency, "sync_retrieval": sync, "requests": n_requests, "tokens": tokens,
            "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 2),
            "p50_ms": round(statistics.median(lat)), "p95_ms": round(float(np.percentile(lat, 95))),
            "mean_parked_ms": round(statistics.mean(s.trace.parked_ms for s in seqs), 1),
            "hops": sum(s.trace.num_hops for s in seqs), "steps": engine.num_steps}


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in rows if not r["sync_retrieval"]]
    sync = [r for r in rows if r["sync_retrieval"]]
    conc = [r["concurrency"] for r in runs]
    fig, (tps, lat) = plt.subplots(1, 2, figsize=(10, 4))
    tps.plot(conc, [r["tokens_per_s"] for r in runs], "o-", label="retrieval off the decode path")
    tps.plot(conc, [runs[0]["tokens_per_s"] * c / runs[0]["concurrency"] for c in conc], ":", color="grey",
             label="linear in concurrency")
    tps.plot([r["concurrency"] for r in sync], [r["tokens_per_s"] for r in sync], "s", color="C3",
             label="retrieval on the decode path")
    tps.set(xlabel="concurrency", ylabel="generated tokens / s", xticks=conc)
    tps.legend()
    for key, style in (("p50_ms", "o-"), ("p95_ms", "o--")):
        lat.plot(conc, [r[key] / 1e3 for r in runs], style, label=key.split("_")[0])
    lat.set(xlabel="concurrency", ylabel="request latency (s)", xticks=conc)
    lat.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--retrieval-latency-ms", type=float, default=150.0)
    ap.add_argument("--sync-at", type=int, default=8, help="concurrency of the sync-retrieval comparison")
    ap.add_argument("--repeat", type=int, default=1, help="run every configuration this many times, round-robin, "
                    "and report the run with the median wall time (use an odd count)")
    ap.add_argument("--plot", help="also draw tokens/s and latency vs concurrency into this PNG")
    args = ap.parse_args(argv)
    need = max(hop_step(i, 2) for i in range(3, args.requests, 4)) + 16 if args.requests > 3 else 0
    if args.max_new_tokens < need:
        ap.error(f"--max-new-tokens {args.max_new_tokens} leaves no room for the scripted third hop; "
                 f"use at least {need}")
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    model, tok = load_model(ModelConfig())
    retriever = build_retriever(RetrieverConfig())
    if args.retrieval_latency_ms:
        retriever = Latency(retriever, args.retrieval_latency_ms)
    run(model, tok, retriever, 2, 2, 32, False)  # warm-up
    configs = [(int(c), False) for c in args.concurrency.split(",")] + [(args.sync_at, True)]
    runs = {cfg: [] for cfg in configs}
    for rep in range(args.repeat):  # round-robin, so a slow spell of the machine hits every configuration alike
        for cfg in configs:
            runs[cfg].append(run(model, tok, retriever, args.requests, cfg[0], args.max_new_tokens, cfg[1]))
            if args.repeat > 1:
                print(f"[engine] repeat {rep + 1}/{args.repeat}: concurrency {cfg[0]} "
                      f"{'sync' if cfg[1] else 'async'} {runs[cfg][-1]['wall_s']} s", file=sys.stderr, flush=True)
    rows = []
    for cfg in configs:  # the run with the median wall time stands for its configuration
        ordered = sorted(runs[cfg], key=lambda r: r["wall_s"])
        rows.append({**ordered[(len(ordered) - 1) // 2], "wall_s_runs": [r["wall_s"] for r in runs[cfg]]})
    median = f", median of {args.repeat} runs" if args.repeat > 1 else ""
    print(f"{args.requests} requests, {args.max_new_tokens} tokens each, 0-3 hops, "
          f"+{args.retrieval_latency_ms:g} ms per search call{median}")
    table = Table("concurrency", "retrieval", ("tokens/s", "{:.1f}"), "p50 ms", "p95 ms", ("parked ms", "{:.1f}"),
                  ("wall s", "{:.1f}"), "steps", "hops")
    for r in rows:
        table.add(r["concurrency"], "sync" if r["sync_retrieval"] else "async", r["tokens_per_s"], r["p50_ms"],
                  r["p95_ms"], r["mean_parked_ms"], r["wall_s"], r["steps"], r["hops"])
    table.print()
    tps = {r["concurrency"]: r["tokens_per_s"] for r in rows if not r["sync_retrieval"]}
    sync = rows[-1]
    summary = {"bench": "engine", "retrieval_latency_ms": args.retrieval_latency_ms, "rows": rows,
               "speedup_c8_vs_c1": round(tps[8] / tps[1], 2) if 8 in tps and 1 in tps else None,
               f"async_vs_sync_at_c{args.sync_at}":
                   round(tps[args.sync_at] / sync["tokens_per_s"], 2) if args.sync_at in tps else None}
    if args.plot:
        plot(rows, args.plot, f"{args.requests} requests x {args.max_new_tokens} tokens, 0-3 hops, "
                              f"+{args.retrieval_latency_ms:g} ms per search")
    emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
