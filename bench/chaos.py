"""Chaos test of ``rig serve``: streaming load while the retriever misbehaves, then a clean request.

The server (default model with its marker adapter, hybrid retriever over the demo knowledge base)
runs in this process on a loopback port. Its retriever is wrapped in ``retrieval.chaos``'s
``FaultyRetriever``: each search call is faulty with probability ``--fault-rate`` (a seeded
generator), the faults taking every mode in turn (raise, too few lists, None, NaN score,
20,000-word text, text None, a non-hit, hang). ``--clients`` concurrent clients share ``--requests`` streaming chat
requests; request i may hop 1 + i % 3 times, the first hop forced, the queries the model's own.
Retries are off, so each dealt fault belongs to exactly one hop and must be visible in that hop's
trace (its error, ``attempts``, ``dropped_hits`` or ``clipped_texts``). Then the faults stop, the
hung searches run out (``--hang-s``), ``/health`` must say retrieval is ok again, and one clean
request must get evidence.

    python bench/chaos.py [--requests 200] [--clients 32] [--fault-rate 0.1] [--max-tokens 32]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import threading
import time
from collections import Counter

import httpx
import numpy as np

from rig_decode.config import RigConfig
from rig_decode.retrieval.chaos import FAULTS, FaultyRetriever
from rig_decode.retrieval.factory import build_retriever
from rig_decode.server import create_app
from rig_decode.server.background import serve_in_thread
from rig_decode.session import RigSession
from harness import emit, fields  # bench/ is on sys.path when run as a script
from server import counter, load


class RandomFaults:
    """A seeded plan: each call faulty with probability ``rate``; the faults take the modes in
    turn, so every mode (hangs included) is dealt about equally often."""

    def __init__(self, rate: float, seed: int = 0):
        self.rate, self.on, self.dealt = rate, True, 0
        self._rng, self._lock = random.Random(seed), threading.Lock()

    def __call__(self, call: int, queries: list[str]) -> str | None:
        with self._lock:
            if not self.on or self._rng.random() >= self.rate:
                return None
            self.dealt += 1
            return FAULTS[(self.dealt - 1) % len(FAULTS)]


def shows_fault(hop: dict) -> bool:
    info = hop.get("info") or {}
    return bool(hop.get("error") or info.get("attempts", 1) > 1 or info.get("dropped_hits")
                or info.get("clipped_texts"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--fault-rate", type=float, default=0.1)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout-s", type=float, default=2.0, help="retriever.timeout_s")
    ap.add_argument("--hang-s", type=float, default=20.0, help="how long a hung search blocks")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = RigConfig.from_dict({
        "rig": {"retrieve_first": True, "max_query_tokens": 16, "evidence_token_budget": 128},
        "retriever": {"top_k": 2, "timeout_s": args.timeout_s},
        "engine": {"retrieval_retries": 0},
        "server": {"max_concurrency": 2 * args.clients}})
    plan = RandomFaults(args.fault_rate, args.seed)
    retriever = FaultyRetriever(build_retriever(cfg.retriever), plan, hang_s=args.hang_s)
    app = create_app(cfg, engine=RigSession(cfg, retriever=retriever).engine)
    model = app.state.rig.model_id
    client_timeout = 300.0
    with serve_in_thread(app) as url:
        plan.on = False
        asyncio.run(load(url, model, 2, 2, 8, label="chaos warm-up"))
        plan.on = True
        warm = httpx.get(url + "/metrics").text
        results, wall = asyncio.run(load(url, model, args.requests, args.clients, args.max_tokens,
                                         hops=lambda i: 1 + i % 3, label="chaos", timeout_s=client_timeout))
        plan.on = False
        degraded_seen = httpx.get(url + "/health").json()
        t0 = time.perf_counter()
        while httpx.get(url + "/health").json()["retrieval"] != "ok" and time.perf_counter() - t0 < args.hang_s + 30:
            time.sleep(0.2)
        recovered_s = time.perf_counter() - t0
        health = httpx.get(url + "/health").json()
        [clean], _ = asyncio.run(load(url, model, 1, 1, args.max_tokens, hops=lambda i: 1, label="chaos clean"))
        metrics = httpx.get(url + "/metrics").text
        in_flight = app.state.rig.front.num_active
    retriever.release()

    ok = [r for r in results if r["status"] == 200 and r["done"] and r["finishes"] == 1 and not r["error"]]
    ids = [i for r in results for i in r["ids"]]
    # each dealt fault hit one hop of the queries in its call; those hops must show it
    dealt = Counter(q for inj in retriever.injected for q in inj.queries)
    shown = Counter(h["query"] for r in results for h in r["hop_records"] if shows_fault(h))
    found = sum(min(n, shown[q]) for q, n in dealt.items())
    modes = Counter(inj.mode for inj in retriever.injected)
    clean_hop = clean["hop_records"][0] if clean["hop_records"] else {}
    lat = [r["latency"] for r in ok]
    row = {"requests": args.requests, "clients": args.clients, "fault_rate": args.fault_rate,
           "timeout_s": args.timeout_s, "completed": len(ok), "errors": len(results) - len(ok),
           "hung": sum(r["timed_out"] for r in results), "lost": args.requests - len(results),
           "duplicate_ids": len(ids) - len(set(ids)), "searches": retriever.num_calls,
           "faults_injected": sum(dealt.values()), "faults_recorded": found,
           "fault_calls_by_mode": dict(sorted(modes.items())),
           "hops_with_errors": sum(bool(h.get("error")) for r in results for h in r["hop_records"]),
           "abandoned_searches": health["abandoned_searches"],
           "degraded_refusals": sum("retrieval degraded" in (h.get("error") or "")
                                    for r in results for h in r["hop_records"]),
           "recovered_s": round(recovered_s, 1), "retrieval_after": health["retrieval"],
           "clean_request_evidence": bool(clean_hop.get("docs")) and not clean_hop.get("error"),
           "server_finished": int(counter(metrics, "rig_finished_total") - counter(warm, "rig_finished_total")),
           "left_in_flight": in_flight, "wall_s": round(wall, 1),
           "p50_ms": round(statistics.median(lat) * 1e3) if lat else None,
           "p95_ms": round(float(np.percentile(lat, 95)) * 1e3) if lat else None,
           "retrieval_at_end_of_load": degraded_seen["retrieval"]}
    print(f"{args.requests} streaming requests from {args.clients} clients, {args.fault_rate:.0%} of searches "
          f"faulty (modes mixed, hangs of {args.hang_s:g}s), retriever.timeout_s {args.timeout_s:g}")
    fields({k: v for k, v in row.items() if k not in ("requests", "clients", "fault_rate", "timeout_s")})
    for r in [r for r in results if r not in ok][:5]:
        print(f"  failed request {r['i']}: status {r['status']}, done {r['done']}, {r['error']}")
    emit({"bench": "chaos", **row})
    good = (len(ok) == args.requests and row["faults_recorded"] == row["faults_injected"]
            and row["clean_request_evidence"] and row["duplicate_ids"] == 0)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
