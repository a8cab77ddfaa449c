"""Per-hop cost: splice into the live cache vs re-prefill vs the bare forward (the floor).

With the default model (a real tokenizer, so the whole hop path of the engine):

For each context length a sequence holds that many tokens in its cache and has just completed a
retrieve marker. Timed, each as the median of ``--repeats`` interleaved runs:

* splice    - the whole hop path of the engine: the marker-completing token goes through the
              matcher (query extraction), the evidence block is rendered and tokenised, the
              sequence and the runner's mask/positions are updated, and the pending end token plus
              the evidence are prefilled onto the cache in one forward.
* floor     - a bare forward of the same tokens over the same cache, nothing else.
* reprefill - what string-based RIG systems do: one forward over context + new tokens, no cache.
* no-ctx    - the new tokens alone with an empty cache (cheaper than any splice can be; shown for
              reference, it is not the floor: see DESIGN.md).

    python bench/splice.py [--contexts 512,1024,2048,4096] [--evidence 128] [--repeats 5]

With ``--shapes`` (random weights, ``bench/random_qwen.py``; ``--device``, ``--quant``, ``--cap-gib``)
the hop is the runner's alone, on random ids: the evidence (the marker's last token and the block)
fed into the row's cache in one step vs a re-prefill of context + evidence from scratch, the KV
buffers the row then holds, and the zero-prefill splice of the same hop: the block's KV assembled
from a warm ``ChunkKVStore`` (``block_kv``) and copied in with ``step(staged=...)``, its tail
recomputed (``engine.zero_prefill.recompute``), or the tokens CacheBlend would choose (``reselect=``,
``select: deviation``), or the tail with the pieces held in the store's host tier (pinned memory,
copied to the card on each hop); on CUDA, the device syncs torch reports during each kind of hop.
Once: on a miss (a cold store), the block's pieces computed one forward each vs in one packed
forward::

    python bench/splice.py --shapes qwen2.5-32b --contexts 2048,8192 --evidence 256 --cap-gib 24

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

import torch

from rig_decode.config import ModelConfig
from rig_decode.engine import EngineOptions
from rig_decode.engine.kv import kv_bytes_per_token_of
from rig_decode.engine.runner_hf import HFModelRunner
from rig_decode.engine.sequence import Sequence
from rig_decode.evidence import EvidenceFormatter
from rig_decode.kernels.chunk_kv import ChunkKVStore
from rig_decode.markers import MarkerMatcher, MarkerSpec, MarkerVocab
from rig_decode.models.cache_arg import cache_kw
from rig_decode.models.loader import load_model
from rig_decode.retrieval.base import Hit

import random_qwen  # bench/ is on sys.path when run as a script
from harness import Table, emit
from timing import Clock, forward_alone, prefill, random_ids, syncs_if_cuda

ZERO_PREFILL = {  # kind -> what it is, as the table says it
    "zero_prefill": "splice",
    "zero_prefill_host": "splice, pieces from the host tier",
    "zero_prefill_deviation": "deviation splice",
}


def bench_context(model, tok, vocab, context: int, evidence: int, repeats: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    marker = vocab.marker_token_ids("error E1234 fixed in release")
    body = torch.randint(100, len(tok) - 100, (context - len(marker) + 1,), generator=g).tolist()
    prefix = body + marker[:-1]  # the cache holds `context` tokens; the marker's last token is next
    end_token = marker[-1]
    filler = " ".join(["Release 4.2.1 of Helios Gateway fixed error E1234 in the TLS layer."] * 40)
    hits = [Hit("d1", filler, 0.9, title="Helios Gateway 4.2.1 changelog")]
    formatter = EvidenceFormatter(tok, budget=evidence)
    new_tokens = [end_token] + formatter.render(hits, 1)
    n_new = len(new_tokens)
    device = next(model.parameters()).device

    runner = HFModelRunner(model, tok.pad_token_id or 0)
    runner.reset(1)
    runner.step([prefix])

    def fresh_sequence() -> Sequence:
        seq = Sequence(0, prefix, MarkerMatcher(vocab), 1 << 20)
        seq.pending.clear()
        for t in marker[:-1]:
            seq.matcher.feed(t)
        return seq

    def splice(seq: Sequence):
        events = seq.matcher.feed(end_token)
        assert events and events[-1].query, "the marker did not complete"
        seq.append([end_token], sampled=True)
        block = formatter.render_block(hits, 1)
        seq.append(block.token_ids, sampled=False)
        runner.step([seq.pending])
        seq.pending.clear()

    ids_new = torch.tensor([new_tokens], device=device)
    pos_new = torch.arange(context, context + n_new, device=device)[None]

    @torch.no_grad()
    def floor():
        model(input_ids=ids_new, position_ids=pos_new, **cache_kw(runner.cache), use_cache=True, logits_to_keep=1)

    full = torch.tensor([prefix + new_tokens], device=device)
    clock = Clock(device)
    times = {"splice": [], "floor": [], "reprefill": [], "no_ctx": []}
    floor(), runner.cache.crop(-n_new)  # warm-up

    def timed_splice():
        seq = fresh_sequence()
        times["splice"].append(clock.ms(lambda: splice(seq)))
        assert runner.lengths[0] == context + n_new
        runner.drop_last(n_new)

    def timed_floor():
        times["floor"].append(clock.ms(floor))
        runner.cache.crop(-n_new)

    for i in range(repeats):  # alternate the order so drift favours neither
        for fn in (timed_splice, timed_floor) if i % 2 == 0 else (timed_floor, timed_splice):
            fn()
        times["no_ctx"].append(clock.ms(lambda: forward_alone(model, ids_new)))
    for _ in range(max(1, repeats // 2)):
        times["reprefill"].append(clock.ms(lambda: forward_alone(model, full)))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"context": context, "new_tokens": n_new, **{f"{k}_ms": round(v, 2) for k, v in med.items()},
            "splice_over_floor": round(med["splice"] / med["floor"], 3),
            "speedup_vs_reprefill": round(med["reprefill"] / med["splice"], 2)}


# -- the runner's hop, on random ids (--shapes) ------------------------------------------------------


def evidence_segments(n: int) -> tuple[list[int], list[list[int]]]:
    """Piece lengths of an ``n``-token block and their leads, as ``EvidenceFormatter`` lays a block
    out (``EvidenceBlock.segments``, ``.leads``): a head, four documents (a 3-token number, then
    the text, computed after a 3-token lead), a tail."""
    head = tail = n // 16
    doc, rest = divmod(n - head - tail, 4)
    lead = [11, 12, 13]
    return [head, *[3, doc - 3] * 4, tail + rest], [[], *[[], lead] * 4, []]


def _hop_tokens(model, context: int, evidence: int, gen) -> tuple[list[int], list[int]]:
    """A ``context``-token row, and what a hop feeds it: the marker's last token, then the evidence."""
    vocab = model.config.vocab_size
    return random_ids(gen, vocab, context), random_ids(gen, vocab, 1 + evidence)


@torch.no_grad()
def runner_hop(model, context: int, evidence: int, repeats: int, clock: Clock, gen,
               kv_budget: int | None = None) -> dict:
    """One hop at ``context``: the splice (``runner.step`` of the marker's last token + evidence) vs
    a re-prefill of context + evidence from scratch (which keeps its cache, as a real one would, to
    decode on); the KV token slots the row holds after the splice (spare columns included)."""
    ctx, new = _hop_tokens(model, context, evidence, gen)
    runner, _ = prefill(model, [ctx], kv_budget)
    splice_once = lambda: runner.step([new])  # noqa: E731
    undo = lambda: runner.drop_last(len(new))  # noqa: E731  (every repeat splices into the same context)
    splice = clock.median_ms(splice_once, repeats, reset=undo)
    syncs = syncs_if_cuda(clock, splice_once, reset=undo)
    held = runner.reserved_slots
    runner = None  # the re-prefill builds its own cache: do not hold two
    full = torch.tensor([ctx + new], device=model.device)
    again = clock.median_ms(lambda: forward_alone(model, full), max(1, repeats // 2))
    return {"new_tokens": len(new), "evidence_prefill_tok_s": len(new) * 1e3 / splice, "splice_ms": splice,
            "splice_syncs": syncs, "kv_held_slots": held, "kv_held_bytes": held * kv_bytes_per_token_of(model),
            "reprefill_ms": again, "reprefill_over_splice": again / splice}


@torch.no_grad()
def zero_prefill_hop(model, context: int, evidence: int, repeats: int, clock: Clock, gen,
                     kv_budget: int | None = None) -> dict:
    """The same hop spliced from a warm ``ChunkKVStore`` (the block's pieces computed before): for
    each kind of ``ZERO_PREFILL``, ``{kind}_ms`` and ``{kind}_syncs``; ``reused``: block tokens whose
    stored KV the tail splices keep."""
    ctx, new = _hop_tokens(model, context, evidence, gen)
    runner, _ = prefill(model, [ctx], kv_budget)
    undo = lambda: runner.drop_last(len(new))  # noqa: E731  (every repeat splices into the same context)
    block, n = new[1:], evidence
    recompute = max(1, math.ceil(EngineOptions().zero_prefill_recompute * n))  # as the engine counts
    segments, leads = evidence_segments(n)
    warm = ChunkKVStore(model)
    on_host = ChunkKVStore(model, max_bytes=0, host_bytes=2 * n * kv_bytes_per_token_of(model))
    out = {"reused": n - recompute}
    for kind, store, count, reselect in (("zero_prefill", warm, n - recompute, 0),
                                         ("zero_prefill_host", on_host, n - recompute, 0),
                                         ("zero_prefill_deviation", warm, n - 1, recompute - 1)):
        store.block_kv(block, segments, count, leads)

        def hop(store=store, count=count, reselect=reselect):
            kv, shifts = store.block_kv(block, segments, count, leads)
            runner.step([new], staged={0: (kv, shifts)}, reselect={0: reselect})

        out[f"{kind}_ms"] = clock.median_ms(hop, repeats, reset=undo)
        out[f"{kind}_syncs"] = syncs_if_cuda(clock, hop, reset=undo)
    return out


@torch.no_grad()
def cold_pieces(model, evidence: int, repeats: int, clock: Clock, gen) -> dict:
    """Zero-prefill on a miss: an evidence block's pieces computed from an empty store, one forward
    per piece (``get``) vs all of them in one packed forward (``block_kv``, what a hop does)."""
    block, (segments, leads) = random_ids(gen, model.config.vocab_size, evidence), evidence_segments(evidence)

    def each():
        store = ChunkKVStore(model)
        for lead, ids in store.pieces(block, segments, evidence, leads):
            store.get(ids, lead)

    def packed():
        ChunkKVStore(model).block_kv(block, segments, evidence, leads)

    return {"pieces": len(segments), "cold_pieces_each_ms": clock.median_ms(each, repeats),
            "cold_pieces_packed_ms": clock.median_ms(packed, repeats)}


def shapes_main(args) -> int:
    """``--shapes``: the runner's hop at each context on a random-weight model."""
    model = random_qwen.from_arguments(args)
    clock, gen = Clock(model.device), torch.Generator().manual_seed(0)
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"{args.shapes} on {model.device}, {args.evidence} evidence tokens + the marker's last token per hop",
          file=sys.stderr)
    rows = []
    for ctx in contexts:
        hop = runner_hop(model, ctx, args.evidence, args.repeats, clock, gen)
        rows.append({"context": ctx, **hop, **zero_prefill_hop(model, ctx, args.evidence, args.repeats, clock, gen)})
        print(f"context {ctx}: done", file=sys.stderr, flush=True)
    cold = cold_pieces(model, args.evidence, args.repeats, clock, gen)
    table = Table("context", ("splice ms", "{:.1f}"), ("reprefill ms", "{:.1f}"), ("speedup vs reprefill", "{:.2f}x"),
                  *((f"zero-prefill {label} ms", "{:.1f}") for label in ZERO_PREFILL.values()), "KV slots held")
    for r in rows:
        table.add(r["context"], r["splice_ms"], r["reprefill_ms"], r["reprefill_over_splice"],
                  *(r[f"{kind}_ms"] for kind in ZERO_PREFILL), r["kv_held_slots"])
    table.print()
    print(f"cold pieces ({cold['pieces']}): {cold['cold_pieces_each_ms']:.1f} ms one forward each, "
          f"{cold['cold_pieces_packed_ms']:.1f} ms in one packed forward")
    emit({"bench": "splice", "shapes": args.shapes, "device": str(model.device), "evidence_tokens": args.evidence,
          "speedup_vs_reprefill": {str(r["context"]): r["reprefill_over_splice"] for r in rows},
          "rows": rows, **cold}, digits=4)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--contexts", default="512,1024,2048,4096")
    ap.add_argument("--evidence", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    random_qwen.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.shapes:
        return shapes_main(args)
    model, tok = load_model(ModelConfig(name=args.model))
    vocab = MarkerVocab(tok, MarkerSpec.special_token())
    print(f"model {args.model} ({next(model.parameters()).dtype}, {torch.get_num_threads()} threads), "
          f"{args.evidence} evidence tokens + 1 pending end-marker token per hop", file=sys.stderr)
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        rows.append(bench_context(model, tok, vocab, ctx, args.evidence, args.repeats))
        print(f"context {ctx}: done", file=sys.stderr, flush=True)
    table = Table("context", ("splice ms", "{:.1f}"), ("floor ms", "{:.1f}"), ("reprefill ms", "{:.1f}"),
                  ("no-ctx ms", "{:.1f}"), ("splice/floor", "{:.3f}x"), ("speedup vs reprefill", "{:.2f}x"))
    for r in rows:
        table.add(r["context"], r["splice_ms"], r["floor_ms"], r["reprefill_ms"], r["no_ctx_ms"],
                  r["splice_over_floor"], r["speedup_vs_reprefill"])
    table.print()
    emit({
        "bench": "splice",
        "model": args.model,
        "evidence_tokens": args.evidence,
        "speedup_vs_reprefill": {str(r["context"]): r["speedup_vs_reprefill"] for r in rows},
        "splice_over_floor": {str(r["context"]): r["splice_over_floor"] for r in rows},
        "rows": rows,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
