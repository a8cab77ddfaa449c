"""Decode-step cost: the runner's KV buffers vs a plain DynamicCache, by batch and context.

A plain ``DynamicCache`` concatenates every layer's keys and values on every step (a copy of the
whole cache); ``BufferedLayer`` writes the new column in place. Same model, same inputs, both
orders interleaved; the median of ``--steps`` decode steps after a prefill of ``T`` tokens per row.
Also checks that both give identical logits.

    python bench/decode_step.py [--batches 1,8,16] [--contexts 300,1000] [--steps 10]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from transformers import DynamicCache

from rig_decode.config import ModelConfig
from rig_decode.engine.runner_hf import new_cache
from rig_decode.models.loader import load_model


@torch.no_grad()
def measure(model, batch: int, context: int, steps: int, buffered: bool) -> tuple[float, torch.Tensor]:
    cache = new_cache(model.config) if buffered else DynamicCache(config=model.config)
    gen = torch.Generator().manual_seed(batch * 7919 + context)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=gen)
    model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    times, logits = [], []
    for i in range(steps):
        step_ids = torch.randint(0, model.config.vocab_size, (batch, 1), generator=gen)
        t0 = time.perf_counter()
        out = model(input_ids=step_ids, position_ids=torch.full((batch, 1), context + i), cache=cache,
                    use_cache=True, logits_to_keep=1)
        times.append(time.perf_counter() - t0)
        logits.append(out.logits)
    return statistics.median(times) * 1e3, torch.cat(logits)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--contexts", default="300,1000")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args(argv)
    model, _ = load_model(ModelConfig())
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        for t in (int(x) for x in args.contexts.split(",")):
            plain_ms, plain = measure(model, b, t, args.steps, buffered=False)
            buf_ms, buf = measure(model, b, t, args.steps, buffered=True)
            rows.append({"batch": b, "context": t, "dynamic_ms": round(plain_ms, 1), "buffered_ms": round(buf_ms, 1),
                         "speedup": round(plain_ms / buf_ms, 2), "identical": bool(torch.equal(plain, buf))})
    print(f"{'batch':>5} {'context':>7} {'DynamicCache ms':>15} {'buffered ms':>11} {'speedup':>7} {'identical':>9}")
    for r in rows:
        print(f"{r['batch']:>5} {r['context']:>7} {r['dynamic_ms']:>15.1f} {r['buffered_ms']:>11.1f} "
              f"{r['speedup']:>6.2f}x {str(r['identical']):>9}")
    print(json.dumps({"bench": "decode_step", "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
