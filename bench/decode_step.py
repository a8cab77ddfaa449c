"""Decode tokens/s of the runner's decode step, eager vs compiled and per weight format, beside the
machine's memory-bandwidth bound.

A decode step reads every weight once and each row's KV once, whatever the batch, so its speed is
bounded by ``bytes read per step / memory bandwidth``: ``bound tok/s = batch x bandwidth / (weight
bytes + KV bytes of every row)``. The bandwidth is measured in the same run (a copy of a 256 MiB
tensor: bytes read + bytes written over its time, the STREAM "copy" convention).

Set-ups of the embedded default model (``--setups``; each ``<weights> <step>``):

* ``packed hf``: fp32, linear weights pre-packed for oneDNN, the step through the HF modules
  (the CPU default before this benchmark: the baseline);
* ``fp32 compiled``: fp32 (plain GEMMs: packed weights cannot be traced), ``DecodeGraph``
  compiled by ``torch.compile(fullgraph=True)``;
* ``int8 hf`` / ``int8 graph`` / ``int8 compiled``: int8 weight-only (``model.quantization:
  int8``), the step through the HF modules, as one eager function, compiled;
* ``int4 compiled``: int4 weight-only, compiled; ``nf4 hf``: bitsandbytes nf4 (its CPU kernels).

Per set-up, batch and context: the median of ``--steps`` steps of ``HFModelRunner`` after a
prefill of random prompts (the first steps, which compile, untimed), tokens/s, the bound, the
share of it reached and the speed over the baseline at the same batch. The greedy tokens of every
set-up are compared with the baseline's over the timed steps (``same tokens``; quantized weights
may pick others).

    python bench/decode_step.py [--batches 1,8] [--contexts 300] [--steps 10] [--setups ...]

With ``--shapes`` (random weights, ``bench/random_qwen.py``; ``--device``, ``--quant``,
``--cap-gib``; ``--steps-kind hf,compiled``): the same on a random model of those shapes::

    python bench/decode_step.py --shapes qwen2.5-32b --quant int4 --steps-kind hf,compiled --batches 1,8 --contexts 1024

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from rig_decode.config import ModelConfig
from rig_decode.engine import HFModelRunner
from rig_decode.models.loader import load_model

import random_qwen  # bench/ is on sys.path when run as a script
from harness import Table, emit
from timing import Clock, random_ids

SETUPS = ("packed hf", "fp32 compiled", "int8 hf", "int8 graph", "int8 compiled", "int4 compiled", "nf4 hf")
WEIGHTS = {"packed": dict(cpu_gemm="packed"), "fp32": dict(cpu_gemm="torch"), "int8": dict(quantization="int8"),
           "int4": dict(quantization="int4"), "nf4": dict(quantization="nf4")}
WARMUP = 3  # untimed steps: compiles (and the recompile automatic dynamic shapes may make)


def copy_bandwidth(device: torch.device, nbytes: int = 256 << 20) -> float:
    """Bytes per second of a device-to-device copy (read + written), best of 10."""
    a = torch.ones(nbytes // 4, device=device)
    b = torch.empty_like(a)
    clock = Clock(device)
    best = min(clock.ms(lambda: b.copy_(a)) for _ in range(10))
    return 2 * nbytes / (best / 1e3)


@torch.no_grad()
def time_runner(model, step_kind: str, batch: int, context: int, steps: int, clock: Clock, seed: int):
    """(median ms of a decode step, greedy tokens of the timed steps) of ``HFModelRunner`` with
    ``decode_step=step_kind`` over ``batch`` random prompts of ``context`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [random_ids(gen, model.config.vocab_size, context) for _ in range(batch)]
    runner = HFModelRunner(model, pad_id=0, decode_step=step_kind)
    runner.reset(0)
    logits = runner.step(runner.add_rows(prompts, share_prefix=False))
    tokens = [[t] for t in logits.argmax(-1).tolist()]
    for _ in range(WARMUP):
        runner.step(tokens)
        runner.drop_last(1)
    times, picked = [], []
    for _ in range(steps):
        times.append(clock.ms(lambda: picked.append(runner.step(tokens).argmax(-1).tolist())))
        runner.drop_last(1)  # every step decodes the same position: the shapes stay those compiled
    return statistics.median(times), picked


def measure(models: dict, setups: list[str], batches: list[int], contexts: list[int], steps: int,
            device: torch.device) -> tuple[float, list[dict]]:
    bandwidth = copy_bandwidth(device)
    clock, rows = Clock(device), []
    for context in contexts:
        for batch in batches:
            base = None
            for setup in setups:
                weights, kind = setup.split()
                model = models[weights]
                ms, picked = time_runner(model, kind, batch, context, steps, clock, seed=batch * 7919 + context)
                tok_s = batch * 1e3 / ms
                bound = batch * bandwidth / random_qwen.decode_bytes(model, batch, context)
                base = base or (tok_s, picked)
                rows.append({"setup": setup, "batch": batch, "context": context, "ms": round(ms, 2),
                             "tok_s": round(tok_s, 1), "bound_tok_s": round(bound, 1),
                             "pct_of_bound": round(100 * tok_s / bound, 1), "speedup": round(tok_s / base[0], 2),
                             "same_tokens": picked == base[1],
                             "weight_mib": round(random_qwen.weight_bytes(model) / 2**20)})
    return bandwidth, rows


def report(rows: list[dict], bandwidth: float, extra: dict) -> None:
    table = Table("set-up", "batch", "context", ("weights MiB", "{:.0f}"), ("ms/step", "{:.1f}"), ("tok/s", "{:.1f}"),
                  ("bound tok/s", "{:.0f}"), ("% of bound", "{:.0f}%"), ("vs first", "{:.2f}x"), "same tokens")
    for r in rows:
        table.add(r["setup"], r["batch"], r["context"], r["weight_mib"], r["ms"], r["tok_s"], r["bound_tok_s"],
                  r["pct_of_bound"], r["speedup"], r["same_tokens"])
    print(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s (read + write)")
    table.print()
    emit({"bench": "decode_step", **extra, "bandwidth_gbs": round(bandwidth / 1e9, 2), "rows": rows})


def shapes_main(args) -> int:
    """``--shapes``: a random-weight model, the step kinds ``--steps-kind``."""
    model = random_qwen.from_arguments(args)
    quant = args.quant
    models = {quant: model}
    setups = [f"{quant} {k}" for k in args.steps_kind.split(",")]
    bandwidth, rows = measure(models, setups, _ints(args.batches), _ints(args.contexts), args.steps, model.device)
    report(rows, bandwidth, {"shapes": args.shapes, "device": str(model.device)})
    return 0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="300")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of: {', '.join(SETUPS)}")
    ap.add_argument("--steps-kind", default="hf,compiled", help="with --shapes: decode_step choices")
    random_qwen.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.shapes:
        return shapes_main(args)
    setups = [s.strip() for s in args.setups.split(",")]
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        ap.error(f"unknown set-ups {unknown}; known: {', '.join(SETUPS)}")
    t0 = time.perf_counter()
    weights = dict.fromkeys(s.split()[0] for s in setups)
    models = {w: load_model(ModelConfig(device="cpu", **WEIGHTS[w]))[0] for w in weights}
    cpu = torch.device("cpu")
    bandwidth, rows = measure(models, setups, _ints(args.batches), _ints(args.contexts), args.steps, cpu)
    report(rows, bandwidth, {"model": ModelConfig().name, "seconds": round(time.perf_counter() - t0)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
