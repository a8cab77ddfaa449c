"""Rollouts for RL through the engine, against rollouts that re-prefill at every hop.

What ``rig_decode/train/grpo.py``'s rollout does for GRPO: ``--questions`` (16) questions of a
training split (``--dataset``, default the synthetic benchmark's train.jsonl; its folder holds
corpus.jsonl), each sampled ``--generations`` (4) times at ``--temperature`` (1.0) with a seeded
generator per rollout, by the embedded default model with its marker adapter, hop budget
``--max-iterations`` (3), at most ``--max-tokens`` (128) sampled tokens, over the real hybrid
retriever built on the corpus; all rollouts of a run in one engine batch (``--batch``, 64).

* ``engine``     the engine: evidence spliced into the KV cache, a hop costs the forward of its evidence;
* ``reprefill``  the same engine in reference mode (``reprefill``): a row with evidence drops its cache
                 and prefills its whole token list again, what rollouts that rebuild the context at every
                 hop (Search-R1's loop, any resubmit loop) compute; its searches run inside the step.

Both get the same prompts and seeds. Per system: rollouts, hops, sampled tokens, tokens prefilled
(prompts, plus per hop: the evidence block and the marker token for ``engine``, the whole context up to
the end of the evidence for ``reprefill``), wall time, sampled tokens/s, and rollouts equal to
``engine``'s token for token (sampling from the same logits with the same generator: exactness makes
them equal unless float noise flips a draw). stdout: the table, the speed-up, then ONE JSON line.

    python bench/rollouts.py [--dataset out/synth/train.jsonl] [--questions 16] [--generations 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # bench/, as when run as a script

from harness import Table, emit  # noqa: E402
from workload import load_synth  # noqa: E402


def log(msg: str) -> None:
    print(f"[rollouts] {msg}", file=sys.stderr, flush=True)


def prefilled(seq, reprefill: bool) -> int:
    """Tokens a rollout's forwards took in besides its sampled ones (see the module docstring)."""
    spans = seq.evidence_spans
    if reprefill:
        return len(seq.prompt_ids) + sum(b for _, b in spans)
    return len(seq.prompt_ids) + sum(b - a + 1 for a, b in spans)


def run(engine, prompts: list[list[int]], seeds: list[int], temperature: float) -> tuple[list, float]:
    import torch

    seqs = [engine.new_sequence(p, seq_id=i, temperature=temperature, seed=s)
            for i, (p, s) in enumerate(zip(prompts, seeds))]
    t0 = time.perf_counter()
    with torch.no_grad():
        engine.generate(seqs)
    return seqs, time.perf_counter() - t0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="out/synth/train.jsonl")
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-iterations", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.temperature <= 0 or args.generations < 1 or args.questions < 1:
        print("bench/rollouts.py: --temperature must be > 0, --generations and --questions >= 1", file=sys.stderr)
        return 2
    from rig_decode.config import RigConfig
    from rig_decode.engine import RigEngine
    from rig_decode.markers import MarkerSpec
    from rig_decode.models.loader import load_model
    from rig_decode.prompt import build_prompt
    from rig_decode.retrieval.factory import build_retriever
    from rig_decode.session import engine_options
    from rig_decode.train.grpo import rollout_seeds

    loaded = load_synth(args.dataset, "bench/rollouts.py")
    if loaded is None:
        return 2
    examples, corpus = loaded
    examples = examples[: args.questions]
    cfg = RigConfig().updated(rig={"max_iterations": args.max_iterations}, model={"max_tokens": args.max_tokens})
    log(f"{len(examples)} questions x {args.generations}; building the retriever over {len(corpus or [])} documents")
    retriever = build_retriever(cfg.retriever, corpus=corpus)
    model, tokenizer = load_model(cfg.model)
    spec = MarkerSpec.from_style(cfg.rig.marker_style)
    prompts = [build_prompt(tokenizer, e.question, spec, cfg.system_prompt())
               for e in examples for _ in range(args.generations)]
    seeds = rollout_seeds(args.seed, len(prompts), step=0)

    results, table = {}, Table("system", "rollouts", "hops", "sampled", ("prefilled", "{:,}"), ("wall s", "{:.1f}"),
                               ("tok/s", "{:.2f}"), "same")
    reference = None
    for name, reprefill in (("engine", False), ("reprefill", True)):
        engine = RigEngine(model, tokenizer, retriever,
                           engine_options(cfg, model, max_batch_size=args.batch, reprefill=reprefill))
        run(engine, prompts[:1], seeds[:1], args.temperature)  # warm-up
        log(f"{name}: {len(prompts)} rollouts")
        seqs, wall = run(engine, prompts, seeds, args.temperature)
        engine.close()
        ids = [s.token_ids for s in seqs]
        reference = reference or ids
        sampled = sum(sum(s.mask[len(s.prompt_ids):]) for s in seqs)
        results[name] = {"rollouts": len(seqs), "hops": sum(s.trace.num_hops for s in seqs), "sampled_tokens": sampled,
                         "prefilled_tokens": sum(prefilled(s, reprefill) for s in seqs), "wall_s": round(wall, 2),
                         "tok_s": round(sampled / wall, 2),
                         "same_as_engine": f"{sum(a == b for a, b in zip(ids, reference))}/{len(ids)}"}
        r = results[name]
        table.add(name, r["rollouts"], r["hops"], r["sampled_tokens"], r["prefilled_tokens"], r["wall_s"], r["tok_s"],
                  r["same_as_engine"])
    speedup = round(results["engine"]["tok_s"] / results["reprefill"]["tok_s"], 2)
    print(f"{len(examples)} questions x {args.generations} rollouts of {args.dataset}, temperature {args.temperature}, "
          f"max_iterations {args.max_iterations}, {args.max_tokens} tokens max, batch {args.batch}, "
          f"model {cfg.model.name}")
    print("\n".join(table.lines()))
    print(f"engine vs reprefill: {speedup}x the sampled tokens/s")
    emit({"bench": "rollouts", "dataset": args.dataset, "questions": len(examples), "generations": args.generations,
          "temperature": args.temperature, "max_iterations": args.max_iterations, "max_tokens": args.max_tokens,
          "batch": args.batch, "systems": results, "speedup": speedup})
    return 0


if __name__ == "__main__":
    sys.exit(main())
