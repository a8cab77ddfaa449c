"""A long prefill under a real memory cap: chunked (``engine.prefill_chunk_tokens``) vs one forward.

One prompt of ``--context`` random tokens is prefilled by ``HFModelRunner`` with each of
``--chunks`` (a chunk size in tokens, or ``none``: the whole prompt in one forward), on a random
model of ``--shapes`` (``bench/random_qwen.py``) capped at ``--cap-gib``: before each prefill
torch's allocator is capped at the cap less what the card then holds outside it (the CUDA context,
kernel images), so the card as a whole stays under the cap, as on a card that small
(``timing.cap_memory``). An allocation beyond it is an out-of-memory error, reported in the row.

Per chunk size: whether it ran (or ran out of memory), its time, and on CUDA the peak memory:
torch's peak allocated, what was allocated before (the weights), the KV the row holds after, the
activation peak (peak less what is held after: what ``rig plan`` must leave beside weights and
KV), and torch's peak reserved plus what the card holds outside torch (the card's peak), against
the cap. Where two chunk sizes ran, their last-token logits are compared (chunking is exact up to
the order of floating-point sums).

    python bench/prefill_cap.py --shapes qwen2.5-32b --quant int4 --cap-gib 24 --context 8192 --chunks 512,none
    python bench/prefill_cap.py --shapes small --device cpu --context 512 --chunks 64,none  # no memory figures

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch

from rig_decode.engine.kv import GiB, kv_bytes_per_token_of
from rig_decode.engine.runner_hf import HFModelRunner

import random_qwen  # bench/ is on sys.path when run as a script
from harness import Table, emit
from timing import Clock, cap_memory, outside_torch, random_ids


def _gib(nbytes: int) -> float:
    return round(nbytes / GiB, 3)


@torch.no_grad()
def prefill_peak(model, ids: list[int], chunk: int | None, cap_bytes: int | None,
                 kv_budget: int | None = None) -> tuple[dict, torch.Tensor | None]:
    """(the row's figures, the last token's logits or None) of one prefill of ``ids`` in chunks of
    ``chunk`` tokens (None: one forward), under ``cap_bytes`` on CUDA."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        cap_memory(device, cap_bytes)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    runner = HFModelRunner(model, pad_id=0, max_slots=kv_budget, prefill_chunk=chunk)
    out, error, clock = [], None, Clock(device)
    try:
        ms = clock.ms(lambda: out.append(runner.step(runner.add_rows([ids], share_prefix=False))[0]))
    except torch.cuda.OutOfMemoryError as e:
        ms, error = None, f"out of memory: {str(e).splitlines()[0]}"
    row = {"chunk": chunk, "ok": error is None, "error": error, "ms": None if ms is None else round(ms, 1)}
    if cuda:
        peak, held = torch.cuda.max_memory_allocated(device), torch.cuda.memory_allocated(device)
        card = torch.cuda.max_memory_reserved(device) + outside_torch(device)
        row.update(weights_gib=_gib(before), peak_allocated_gib=_gib(peak),
                   kv_gib=_gib(held - before) if error is None else None,
                   activation_peak_gib=_gib(peak - held) if error is None else None,
                   peak_card_gib=_gib(card), fits_cap=None if cap_bytes is None else card <= cap_bytes)
    del runner
    return row, out[0] if out else None


def run(model, context: int, chunks: list[int | None], cap_bytes: int | None, kv_budget: int | None = None,
        seed: int = 0) -> dict:
    """Every chunk size's row over the same prompt, and how their logits compare."""
    ids = random_ids(torch.Generator().manual_seed(seed), model.config.vocab_size, context)
    prefill_peak(model, ids[:64], None, cap_bytes)  # untimed: the first forward's one-time set-up
    rows, logits = [], {}
    for chunk in chunks:
        row, out = prefill_peak(model, ids, chunk, cap_bytes, kv_budget)
        rows.append(row)
        if out is not None:
            logits[chunk] = out.float()
    compared = list(logits.values())
    same = None
    if len(compared) > 1:
        same = {"same_argmax": all(bool((c.argmax() == compared[0].argmax()).item()) for c in compared[1:]),
                "max_abs_diff": max(float((c - compared[0]).abs().max()) for c in compared[1:])}
    return {"context": context, "kv_bytes_per_token": kv_bytes_per_token_of(model), "rows": rows, "compared": same}


def report(result: dict, header: dict) -> None:
    def chunk(c):
        return "none (one forward)" if c is None else f"{c} tokens"

    table = Table(("chunk", "<"), ("result", "<"), ("ms", "{:.1f}"), ("weights GiB", "{:.2f}"),
                  ("peak alloc. GiB", "{:.2f}"), ("KV GiB", "{:.2f}"), ("activations GiB", "{:.2f}"),
                  ("card peak GiB", "{:.2f}"), "fits cap")
    for r in result["rows"]:
        table.add(chunk(r["chunk"]), "ok" if r["ok"] else "OOM", r["ms"], r.get("weights_gib"),
                  r.get("peak_allocated_gib"), r.get("kv_gib"), r.get("activation_peak_gib"), r.get("peak_card_gib"),
                  r.get("fits_cap"))
    table.print()
    for r in result["rows"]:
        if r["error"]:
            print(f"{chunk(r['chunk'])}: {r['error']}")
    if result["compared"]:
        print(f"last-token logits: same argmax {result['compared']['same_argmax']}, "
              f"max |diff| {result['compared']['max_abs_diff']:.3g}")
    emit({"bench": "prefill_cap", **header, **result}, digits=4)


def parse_chunks(text: str) -> list[int | None]:
    chunks = [None if c.strip().lower() == "none" else int(c) for c in text.split(",")]
    if any(c is not None and c < 1 for c in chunks):
        raise SystemExit(f"--chunks: a chunk is at least 1 token, or none; got {text!r}")
    return chunks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=8192, help="tokens of the prompt")
    ap.add_argument("--chunks", default="512,none", help="chunk sizes in tokens, or none (one forward)")
    ap.add_argument("--kv-budget", type=int, help="token slots the runner's KV buffers may hold (default: no bound)")
    random_qwen.add_arguments(ap)
    args = ap.parse_args(argv)
    if not args.shapes:
        ap.error("--shapes is required (random weights of those shapes)")
    chunks = parse_chunks(args.chunks)
    model = random_qwen.from_arguments(args)
    device = next(model.parameters()).device
    cap = int(args.cap_gib * GiB) if args.cap_gib else None
    print(f"[prefill_cap] {args.shapes} ({model.config.num_hidden_layers} layers, {args.quant}) on {device}, "
          f"{args.context} tokens, cap {args.cap_gib or 'none'} GiB", file=sys.stderr, flush=True)
    result = run(model, args.context, chunks, cap, args.kv_budget)
    report(result, {"shapes": args.shapes, "layers": model.config.num_hidden_layers, "quantization": args.quant,
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "cap_gib": args.cap_gib, "stored_gib": _gib(random_qwen.stored_bytes(model))})
    return 0  # running out of memory is a finding (its row says so), not a failure of the benchmark


if __name__ == "__main__":
    sys.exit(main())
