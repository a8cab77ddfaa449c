"""Per-hop cost: splice into the live cache vs re-prefill vs the bare forward (the floor).

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

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from rig_decode.config import ModelConfig
from rig_decode.engine.runner_hf import HFModelRunner
from rig_decode.engine.sequence import Sequence
from rig_decode.evidence import EvidenceFormatter
from rig_decode.markers import MarkerMatcher, MarkerSpec, MarkerVocab
from rig_decode.models.loader import load_model
from rig_decode.retrieval.base import Hit

from harness import Table, emit  # bench/ is on sys.path when run as a script
from timing import Clock, forward_alone


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
        model(input_ids=ids_new, position_ids=pos_new, cache=runner.cache, use_cache=True, logits_to_keep=1)

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--contexts", default="512,1024,2048,4096")
    ap.add_argument("--evidence", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
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
