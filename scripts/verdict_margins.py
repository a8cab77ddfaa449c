"""Does a marker adapter read the evidence before its verdict? Comparison and yes/no traces, scored.

    python scripts/make_marker_data.py --synth out/wide-v24 --out out/md-v24 --variants special --splits dev \
        --kinds compare,yesno
    python scripts/verdict_margins.py --traces out/md-v24/dev-kinds-compare+yesno-special.jsonl \
        --synth out/wide-v24 --adapter auto --adapter out/adapter-cy2

``--traces`` and ``--synth`` repeat in pairs: the traces of several worlds are scored together.

Each trace is teacher-forced up to its answer (its own queries and evidence, as the decoder splices
them), and the model's log-probability of the two possible answers is compared there: " yes" and
" no" for a yes/no question, the two entities for a comparison. Per adapter and kind it prints how
often the preferred answer is right, how often it is "no" or the second entity whatever the truth,
and the AUC of the margin against the truth: 0.5 means the verdict does not depend on what the
evidence says, however often it is right. Yes/no questions about one chain ("Is the X of Y Z?")
and about two ("Do A and B share their X?") are counted apart, and so are the traces that asked
for both values in one search (``make_marker_data.py --one-search``). ``--restate`` also scores
each trace with the values its verdict rests on said just before it ("The budget of A is $3
million. The budget of B is $5 million. So the answer is"; from the records' plans): does the model
compare two values once they stand side by side? The table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

from rig_decode.config import ModelConfig
from rig_decode.eval.world_schema import RELATION
from rig_decode.models.cache_arg import cache_kw
from rig_decode.models.loader import load_model
from rig_decode.train.data import spoken
from rig_decode.train.lora import answer_start


KINDS = ("yes/no, one chain", "yes/no, two chains", "comparison")


def kind(rec: dict) -> str:
    if rec["kind"] == "compare":
        return "comparison"
    return "yes/no, two chains" if rec["template"].startswith("same:") else "yes/no, one chain"


def candidates(rec: dict) -> tuple[str, str]:
    """The two answers a verdict chooses between: (yes, no), or the (first, second) entity compared."""
    if rec["kind"] == "yesno":
        return "yes", "no"
    chain = rec["entities"]  # [a0,] a, [b0,] b: the compared entities end each half
    return chain[len(chain) // 2 - 1], chain[-1]


def restatement(rec: dict) -> str:
    """The values the verdict rests on, as a sentence each, then "So the answer is": the last hop
    of each of two chains, or of the one chain whose value a yes/no question names."""
    plan = rec["plan"]
    ends = [plan[-1]] if kind(rec) == "yes/no, one chain" else [plan[len(plan) // 2 - 1], plan[-1]]
    said = [f"The {RELATION[p['relation']].noun} of {p['entity']} is {p['value']}." for p in ends]
    return " " + " ".join(said) + " So the answer is"


@torch.no_grad()
def answer_logprobs(model, prefix: list[int], answers: list[list[int]]) -> list[float]:
    """The log-probability of each answer's tokens after ``prefix``; the prefix runs once and its
    cache serves every answer (cut back to the prefix after each)."""
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=torch.tensor([prefix]), **cache_kw(cache), use_cache=True).logits
    first = logits[0, -1].float().log_softmax(-1)
    scores = []
    for answer in answers:
        lp = float(first[answer[0]])
        if len(answer) > 1:
            logits = model(input_ids=torch.tensor([answer[:-1]]), **cache_kw(cache), use_cache=True).logits
            lp += float(logits[0].float().log_softmax(-1).gather(1, torch.tensor(answer[1:])[:, None]).sum())
            cache.crop(-(len(answer) - 1))  # back to the prefix
        scores.append(lp)
    return scores


def auc(margins: list[float], truth: list[bool]) -> float | None:
    """Probability that a true case's margin beats a false one's (ties count half)."""
    pos = [m for m, t in zip(margins, truth) if t]
    neg = [m for m, t in zip(margins, truth) if not t]
    if not pos or not neg:
        return None
    return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))


def score(model, tok, items: list[tuple[dict, dict]], restate: bool = False) -> dict[str, dict]:
    """Per kind of question (and ", one search" where one search brought both values): n, the
    share whose preferred answer is right, the share that prefers "no" or the second entity, and
    the margin's AUC against the truth, over (trace, its question's record) pairs."""
    rows: dict[str, list[tuple[float, bool]]] = {f"{k}{s}": [] for k in KINDS for s in ("", ", one search")}
    for t, rec in tqdm(items, desc="verdicts", file=sys.stderr):
        prefix = t["input_ids"][: answer_start(t["mask"])]
        if restate:
            prefix = prefix + tok.encode(restatement(rec), add_special_tokens=False)
        first, second = candidates(rec)
        lp_first, lp_second = answer_logprobs(model, prefix, [tok.encode(spoken(a), add_special_tokens=False)
                                                               for a in (first, second)])
        searched = ", one search" if t.get("kind") == "one_search" else ""  # both values in one block
        rows[kind(rec) + searched].append((lp_first - lp_second, rec["answer"] == first))
    out = {}
    for k, pairs in rows.items():
        if pairs:
            margins, truth = [m for m, _ in pairs], [t for _, t in pairs]
            out[k] = {"n": len(pairs), "right": sum((m > 0) == t for m, t in pairs) / len(pairs),
                      "prefers_second": sum(m <= 0 for m in margins) / len(pairs), "auc": auc(margins, truth)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", action="append", required=True,
                    help="traces of comparison and yes/no questions (make_marker_data.py); repeatable")
    ap.add_argument("--synth", action="append", required=True,
                    help="the `rig synth` folder the traces were built from; one per --traces, in order")
    ap.add_argument("--split", default="dev")
    ap.add_argument("--adapter", action="append", required=True,
                    help="auto (the shipped adapter) or an adapter folder; repeatable")
    ap.add_argument("--restate", action="store_true",
                    help="also score each trace with the values its verdict rests on said before it")
    args = ap.parse_args(argv)
    if len(args.traces) != len(args.synth):
        ap.error(f"{len(args.traces)} --traces but {len(args.synth)} --synth: give one world per traces file")
    items = []
    for traces, synth in zip(args.traces, args.synth):
        records = {r["id"]: r for r in map(json.loads, (Path(synth) / f"{args.split}.jsonl").open(encoding="utf-8"))}
        found = [(t, records[t["id"]]) for t in map(json.loads, Path(traces).open(encoding="utf-8"))
                 if records.get(t["id"], {}).get("kind") in ("yesno", "compare")]
        if not found:
            ap.error(f"{traces}: no comparison or yes/no traces of {synth}/{args.split}.jsonl")
        items += found
    results = {}
    for adapter in args.adapter:
        model, tok = load_model(ModelConfig(adapter=adapter, device="cpu", cpu_gemm="torch"))
        results[adapter] = {"evidence": score(model, tok, items)}
        if args.restate:
            results[adapter]["restated"] = score(model, tok, items, restate=True)
    print("| adapter | before the verdict | kind | n | right % | says no / second entity % | AUC of the margin |")
    print("|---|---|---|---:|---:|---:|---:|")
    for adapter, modes in results.items():
        for mode, kinds in modes.items():
            for k, r in kinds.items():
                auc_text = "-" if r["auc"] is None else f"{r['auc']:.2f}"
                print(f"| {adapter} | {mode} | {k} | {r['n']} | {100 * r['right']:.1f} "
                      f"| {100 * r['prefers_second']:.1f} | {auc_text} |")
    print(json.dumps({"verdict_margins": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
