"""Load test of ``rig serve`` on loopback: many streaming clients, mixed hop counts.

The server (default model, demo knowledge base) runs in this process on a free port; ``--clients``
concurrent streaming clients share ``--requests`` chat requests. Request i may hop i % 4 times
(0-3; the first hop is forced, the queries are the model's own). Every request is checked: HTTP
200, exactly one finish chunk, the stream ends with ``data: [DONE]``, a response id not seen
before; the server's own counters must agree (every request counted once, none left running).

    python bench/server.py [--requests 200] [--clients 32] [--max-tokens 48]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time

import httpx
import numpy as np

from rig_decode.config import RigConfig
from rig_decode.server import create_app
from rig_decode.server.background import serve_in_thread
from harness import emit, fields  # bench/ is on sys.path when run as a script
from workload import QUESTIONS


async def one(http: httpx.AsyncClient, url: str, model: str, i: int, max_tokens: int, hops: int) -> dict:
    """One streaming chat request, checked; ``hop_records``: its trace's hops (the finish chunk's)."""
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            "rig": {"max_iterations": hops}}
    t0 = time.perf_counter()
    out = {"i": i, "status": None, "done": False, "finishes": 0, "ids": set(), "ttft": None, "hops": 0,
           "tokens": 0, "error": None, "timed_out": False, "hop_records": []}
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
            out["status"] = r.status_code
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    out["done"] = True
                    continue
                chunk = json.loads(data)
                out["ids"].add(chunk["id"])
                for c in chunk["choices"]:
                    if c["delta"].get("content") and out["ttft"] is None:
                        out["ttft"] = time.perf_counter() - t0
                    if c["finish_reason"]:
                        out["finishes"] += 1
                        out["hops"] = chunk["rig"]["num_hops"]
                        out["hop_records"] = chunk["rig"]["hops"]
                if chunk.get("usage"):
                    out["tokens"] = chunk["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001 - every failure is counted, none stops the test
        out["error"] = f"{type(e).__name__}: {e}"
        out["timed_out"] = isinstance(e, httpx.TimeoutException)
    out["latency"] = time.perf_counter() - t0
    return out


async def load(url: str, model: str, n: int, clients: int, max_tokens: int, hops=lambda i: i % 4,
               label: str = "server bench", timeout_s: float = 600.0) -> tuple[list[dict], float]:
    """``n`` requests from ``clients`` concurrent clients; request i may hop ``hops(i)`` times."""
    todo: asyncio.Queue = asyncio.Queue()
    for i in range(n):
        todo.put_nowait(i)
    results: list[dict] = []

    async def client():
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s)) as http:
            while not todo.empty():
                i = todo.get_nowait()
                results.append(await one(http, url, model, i, max_tokens, hops(i)))
                if len(results) % 20 == 0 or len(results) == n:
                    print(f"[{label}] {len(results)}/{n} requests done, {time.perf_counter() - t0:.0f}s",
                          file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return results, time.perf_counter() - t0


def counter(metrics: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", metrics, re.M))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args(argv)
    cfg = RigConfig.from_dict({"rig": {"retrieve_first": True, "max_query_tokens": 16, "evidence_token_budget": 128},
                               "retriever": {"top_k": 2}, "server": {"max_concurrency": 2 * args.clients}})
    app = create_app(cfg)
    model = app.state.rig.model_id
    with serve_in_thread(app) as url:
        asyncio.run(load(url, model, 4, 4, 8))  # warm-up
        warm = httpx.get(url + "/metrics").text
        results, wall = asyncio.run(load(url, model, args.requests, args.clients, args.max_tokens))
        metrics = httpx.get(url + "/metrics").text
        in_flight = app.state.rig.front.num_active
    ok = [r for r in results if r["status"] == 200 and r["done"] and r["finishes"] == 1 and not r["error"]]
    errors = [r for r in results if r not in ok]
    ids = [next(iter(r["ids"])) for r in ok if len(r["ids"]) == 1]
    served = counter(metrics, "rig_finished_total") - counter(warm, "rig_finished_total")
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    hops = {h: sum(r["hops"] == h for r in ok) for h in sorted({r["hops"] for r in ok})}
    row = {"requests": args.requests, "clients": args.clients, "max_tokens": args.max_tokens,
           "completed": len(ok), "errors": len(errors), "lost": args.requests - len(results),
           "duplicate_ids": len(ids) - len(set(ids)), "server_finished": int(served), "left_in_flight": in_flight,
           "wall_s": round(wall, 1), "tokens_per_s": round(tokens / wall, 2),
           "p50_ms": round(statistics.median(lat) * 1e3) if lat else None,
           "p95_ms": round(float(np.percentile(lat, 95)) * 1e3) if lat else None,
           "ttft_p50_ms": round(statistics.median(ttft) * 1e3) if ttft else None,
           "hops": hops}
    print(f"{args.requests} streaming requests from {args.clients} concurrent clients, "
          f"{args.max_tokens} tokens max, 0-3 hops")
    fields({k: row[k] for k in ("completed", "errors", "lost", "duplicate_ids", "server_finished", "left_in_flight",
                                "wall_s", "tokens_per_s", "p50_ms", "p95_ms", "ttft_p50_ms", "hops")})
    for r in errors[:5]:
        print(f"  failed request {r['i']}: status {r['status']}, done {r['done']}, {r['error']}")
    emit({"bench": "server", **row})
    return 0 if not errors and row["lost"] == 0 and row["duplicate_ids"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
