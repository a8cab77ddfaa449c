"""Decode-step cost by batch and context: KV buffers vs DynamicCache, packed vs plain CPU GEMMs.

Three set-ups of the default model, measured interleaved on the same inputs:

* ``dynamic``: a plain ``DynamicCache`` (concatenates every layer's keys and values each step,
  a copy of the whole cache) and plain ``F.linear``;
* ``buffered``: the runner's ``BufferedLayer`` cache (writes the new column in place), plain GEMMs;
* ``packed``: buffered cache and linear weights pre-packed for oneDNN (``model.cpu_gemm: packed``,
  the CPU default; ``rig_decode.models.cpu_gemm``).

Per set-up: the median of ``--steps`` decode steps after a prefill of ``T`` tokens per row, and
``tok/s x`` - tokens per second relative to batch 1 of the same set-up at the same context (the
batching gain a serving engine can get from decode alone). Checks that dynamic and buffered give
identical logits and that packed picks the same greedy tokens.

    python bench/decode_step.py [--batches 1,8,16] [--contexts 300,1000] [--steps 10] [--repeats 2]

With ``--shapes`` (random weights, ``bench/random_qwen.py``; ``--device``, ``--quant``, ``--cap-gib``):
decode tokens/s of the engine's runner (``HFModelRunner`` steps after a prefill of random prompts,
greedy), per batch and context, each the median of ``--steps`` steps after one warm-up::

    python bench/decode_step.py --shapes qwen2.5-32b --batches 1,8 --contexts 1024 --steps 16 --cap-gib 24

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from transformers import DynamicCache

from rig_decode.config import ModelConfig
from rig_decode.models.kv_buffers import new_cache
from rig_decode.models.cache_arg import cache_kw
from rig_decode.models.loader import load_model

import random_qwen  # bench/ is on sys.path when run as a script
from harness import Table, emit
from timing import Clock, prefill, random_ids

SETUPS = ("dynamic", "buffered", "packed")


@torch.no_grad()
def measure(model, batch: int, context: int, steps: int, buffered: bool) -> tuple[list[float], torch.Tensor]:
    cache = new_cache(model.config) if buffered else DynamicCache(config=model.config)
    gen = torch.Generator().manual_seed(batch * 7919 + context)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=gen)
    model(input_ids=ids, **cache_kw(cache), use_cache=True, logits_to_keep=1)
    times, logits = [], []
    for i in range(steps):
        step_ids = torch.randint(0, model.config.vocab_size, (batch, 1), generator=gen)
        t0 = time.perf_counter()
        out = model(input_ids=step_ids, position_ids=torch.full((batch, 1), context + i), **cache_kw(cache),
                    use_cache=True, logits_to_keep=1)
        times.append(time.perf_counter() - t0)
        logits.append(out.logits)
    return times, torch.cat(logits)


@torch.no_grad()
def runner_tok_s(model, batch: int, context: int, steps: int, clock: Clock, gen,
                 kv_budget: int | None = None) -> float:
    """Decode tokens/s of ``HFModelRunner`` at ``batch`` rows of ``context`` random tokens, greedy;
    its KV buffers bounded by ``kv_budget`` tokens, as the engine bounds them."""
    prompts = [random_ids(gen, model.config.vocab_size, context) for _ in range(batch)]
    runner, logits = prefill(model, prompts, kv_budget)
    state = {"logits": logits}

    def step():
        state["logits"] = runner.step([[t] for t in state["logits"].argmax(-1).tolist()])

    return batch * 1e3 / clock.median_ms(step, steps)


def shapes_main(args) -> int:
    """``--shapes``: the runner's decode tokens/s on a random-weight model."""
    model = random_qwen.from_arguments(args)
    clock, gen = Clock(model.device), torch.Generator().manual_seed(0)
    rows = [{"batch": b, "context": t, "tok_s": runner_tok_s(model, b, t, args.steps, clock, gen)}
            for t in (int(x) for x in args.contexts.split(",")) for b in (int(x) for x in args.batches.split(","))]
    table = Table("batch", "context", ("tokens/s", "{:.1f}"))
    for r in rows:
        table.add(r["batch"], r["context"], r["tok_s"])
    table.print()
    emit({"bench": "decode_step", "shapes": args.shapes, "device": str(model.device), "rows": rows}, digits=3)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--contexts", default="300,1000")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds over the three set-ups")
    random_qwen.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.shapes:
        return shapes_main(args)
    plain, _ = load_model(ModelConfig(device="cpu", cpu_gemm="torch"))
    packed, _ = load_model(ModelConfig(device="cpu", cpu_gemm="packed"))
    models = {"dynamic": (plain, False), "buffered": (plain, True), "packed": (packed, True)}
    batches = [int(x) for x in args.batches.split(",")]
    rows = []
    for t in (int(x) for x in args.contexts.split(",")):
        for b in batches:
            times = {s: [] for s in SETUPS}
            logits = {}
            for _ in range(args.repeats):
                for s in SETUPS:
                    model, buffered = models[s]
                    ts, logits[s] = measure(model, b, t, args.steps, buffered)
                    times[s] += ts
            row = {"batch": b, "context": t, **{f"{s}_ms": round(statistics.median(times[s]) * 1e3, 1) for s in SETUPS},
                   "identical_cache": bool(torch.equal(logits["dynamic"], logits["buffered"])),
                   "same_argmax_packed": bool(torch.equal(logits["buffered"].argmax(-1), logits["packed"].argmax(-1)))}
            rows.append(row)
        base = next(r for r in rows if r["context"] == t and r["batch"] == batches[0])
        for r in rows:
            if r["context"] == t:
                for s in SETUPS:
                    r[f"{s}_tok_s_x"] = round(r["batch"] / batches[0] * base[f"{s}_ms"] / r[f"{s}_ms"], 2)
    table = Table("batch", "context", ("dynamic ms", "{:.1f}"), ("buffered ms", "{:.1f}"), ("packed ms", "{:.1f}"),
                  ("packed vs buffered", "{:.2f}x"), ("tok/s x buffered", "{:.2f}x"), ("tok/s x packed", "{:.2f}x"),
                  "same tokens")
    for r in rows:
        table.add(r["batch"], r["context"], r["dynamic_ms"], r["buffered_ms"], r["packed_ms"],
                  r["buffered_ms"] / r["packed_ms"], r["buffered_tok_s_x"], r["packed_tok_s_x"],
                  r["identical_cache"] and r["same_argmax_packed"])
    table.print()
    emit({"bench": "decode_step", "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
