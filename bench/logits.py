"""Does the per-step marker logits processing need a fused kernel? Its cost beside the forward.

Each decode step the engine runs its logits processors over the batch (hop budget, stray end
delimiter, query cap, no-stop-in-query, newline-ends-query, and citations when on) before sampling.
A fused kernel would only pay off if that were a visible share of the step. For batch sizes B, with
the rows in mixed marker states (outside a marker, inside a query, at the hop budget), this times:

* processors - every processor of a real ``RigEngine`` (citations on) over ``[B, vocab]`` logits;
* forward    - one decode step of the real default model with ``context`` tokens per row cached.

    python bench/logits.py [--batches 1,8,32,64] [--context 512] [--repeats 20]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import sys

import torch

from rig_decode.config import ModelConfig
from rig_decode.engine.engine import EngineOptions, RigEngine
from rig_decode.engine.runner_hf import HFModelRunner
from rig_decode.models.loader import load_model

from harness import Table, emit  # bench/ is on sys.path when run as a script
from timing import Clock


def _rows(engine: RigEngine, batch: int, prompt: list[int]):
    """Sequences in the three states the processors distinguish."""
    vocab = engine.vocab
    start = vocab.marker_token_ids("q")[: len(vocab.marker_token_ids("q")) - 1]  # an open query
    rows = []
    for i in range(batch):
        s = engine.new_sequence(prompt, seq_id=i)
        feed = [] if i % 3 == 0 else start if i % 3 == 1 else vocab.marker_token_ids("done") * engine.opts.max_iterations
        for t in feed:
            s.matcher.feed(t)
            s.append([t], sampled=True)
            s.num_generated += 1
        rows.append(s)
    return rows


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model, tok = load_model(ModelConfig(name=args.model, adapter=None))
    clock = Clock(next(model.parameters()).device)
    engine = RigEngine(model, tok, None, EngineOptions(max_iterations=2, citations=True))
    vocab_size = model.config.vocab_size
    prompt = torch.randint(100, vocab_size, (args.context,)).tolist()
    results = []
    for batch in [int(b) for b in args.batches.split(",")]:
        rows = _rows(engine, batch, prompt)
        logits = torch.randn(batch, vocab_size)

        def processors():
            scores = logits.clone()
            for p in engine.processors:
                scores = p.apply(rows, scores)
            return scores

        runner = HFModelRunner(model, tok.pad_token_id or 0)
        runner.prefill([prompt] * batch)
        ids = [[5]] * batch

        def forward():
            runner.step(ids)
            runner.drop_last(1)  # same context every repeat

        p_ms = clock.median_ms(processors, args.repeats)
        f_ms = clock.median_ms(forward, max(3, args.repeats // 4))
        results.append({"batch": batch, "processors_ms": round(p_ms, 3), "forward_ms": round(f_ms, 2),
                        "share": round(p_ms / (p_ms + f_ms), 4)})
        print(f"batch {batch}: processors {p_ms:.2f} ms, forward {f_ms:.1f} ms", file=sys.stderr)
    print(f"model {args.model}, vocab {vocab_size}, context {args.context}, "
          f"{len(engine.processors)} processors, CPU threads {torch.get_num_threads()}\n")
    table = Table("batch", ("processors ms", "{:.2f}"), ("forward ms", "{:.1f}"),
                  ("processors share of the step", "{:.1%}"), markdown=True)
    for r in results:
        table.add(r["batch"], r["processors_ms"], r["forward_ms"], r["share"])
    table.print()
    emit({"bench": "logits", "model": args.model, "context": args.context, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
