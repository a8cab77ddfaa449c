"""Does a marker adapter read the evidence before its verdict? Comparison and yes/no traces, scored.

    python scripts/make_marker_data.py --synth out/wide-v24 --out out/md-v24 --variants special --splits dev \
        --kinds compare,yesno
    python scripts/verdict_margins.py --traces out/md-v24/dev-kinds-compare+yesno-special.jsonl \
        --synth out/wide-v24 --adapter auto --adapter out/adapter-cy2

Each trace is teacher-forced up to its answer (its own queries and evidence, as the decoder splices
them), and the model's log-probability of the two possible answers is compared there: " yes" and
" no" for a yes/no question, the two entities for a comparison. Per adapter and kind it prints how
often the preferred answer is right, how often it is "no" or the second entity whatever the truth,
and the AUC of the margin against the truth: 0.5 means the verdict does not depend on what the
evidence says, however often it is right. The table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from rig_decode.config import ModelConfig
from rig_decode.models.loader import load_model
from rig_decode.train.data import spoken
from rig_decode.train.lora import answer_start


def candidates(rec: dict) -> tuple[str, str]:
    """The two answers a verdict chooses between: (yes, no), or the (first, second) entity compared."""
    if rec["kind"] == "yesno":
        return "yes", "no"
    chain = rec["entities"]  # [a0,] a, [b0,] b: the compared entities end each half
    return chain[len(chain) // 2 - 1], chain[-1]


@torch.no_grad()
def logprob(model, prefix: list[int], answer: list[int]) -> float:
    ids = torch.tensor([prefix + answer])
    logits = model(input_ids=ids).logits[0, len(prefix) - 1 : -1].float().log_softmax(-1)
    return float(logits.gather(1, torch.tensor(answer)[:, None]).sum())


def auc(margins: list[float], truth: list[bool]) -> float | None:
    """Probability that a true case's margin beats a false one's (ties count half)."""
    pos = [m for m, t in zip(margins, truth) if t]
    neg = [m for m, t in zip(margins, truth) if not t]
    if not pos or not neg:
        return None
    return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))


def score(adapter: str, traces: list[dict], records: dict[str, dict]) -> dict[str, dict]:
    model, tok = load_model(ModelConfig(adapter=None if adapter == "none" else adapter, device="cpu",
                                        cpu_gemm="torch"))
    rows: dict[str, list[tuple[float, bool]]] = {"yesno": [], "compare": []}
    for t in traces:
        rec = records[t["id"]]
        first, second = candidates(rec)
        prefix = t["input_ids"][: answer_start(t["mask"])]
        margin = (logprob(model, prefix, tok.encode(spoken(first), add_special_tokens=False))
                  - logprob(model, prefix, tok.encode(spoken(second), add_special_tokens=False)))
        rows[rec["kind"]].append((margin, rec["answer"] == first))
    out = {}
    for kind, pairs in rows.items():
        if pairs:
            margins, truth = [m for m, _ in pairs], [t for _, t in pairs]
            out[kind] = {"n": len(pairs), "right": sum((m > 0) == t for m, t in pairs) / len(pairs),
                         "prefers_second": sum(m <= 0 for m in margins) / len(pairs),
                         "auc": auc(margins, truth)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", required=True, help="traces of comparison and yes/no questions (make_marker_data.py)")
    ap.add_argument("--synth", required=True, help="the `rig synth` folder the traces were built from")
    ap.add_argument("--split", default="dev")
    ap.add_argument("--adapter", action="append", required=True,
                    help="auto (the shipped adapter), none (the bare model) or an adapter folder; repeatable")
    args = ap.parse_args(argv)
    records = {r["id"]: r for r in map(json.loads, (Path(args.synth) / f"{args.split}.jsonl").open(encoding="utf-8"))}
    traces = [t for t in map(json.loads, Path(args.traces).open(encoding="utf-8"))
              if records.get(t["id"], {}).get("kind") in ("yesno", "compare")]
    if not traces:
        ap.error(f"{args.traces}: no comparison or yes/no traces of {args.synth}/{args.split}.jsonl")
    results = {a: score(a, traces, records) for a in args.adapter}
    print("| adapter | kind | n | right % | says no / second entity % | AUC of the margin |")
    print("|---|---|---:|---:|---:|---:|")
    for a, kinds in results.items():
        for kind, r in kinds.items():
            auc_text = "-" if r["auc"] is None else f"{r['auc']:.2f}"
            print(f"| {a} | {kind} | {r['n']} | {100 * r['right']:.1f} | {100 * r['prefers_second']:.1f} | {auc_text} |")
    print(json.dumps({"verdict_margins": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
