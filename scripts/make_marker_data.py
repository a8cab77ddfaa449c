"""Build supervised marker traces from the synthetic benchmark with the real retriever.

    python scripts/make_marker_data.py --synth out/synth --out out/marker-data [--variants special,text,json]
    python scripts/make_marker_data.py --synth out/synth --out out/marker-data --conversations --variants special

Reads ``corpus.jsonl`` and ``train.jsonl``/``dev.jsonl`` of ``rig synth``'s output, indexes the
corpus with the configured retriever (default: hybrid over the embedded MiniLM), and writes one
JSONL of traces per split and marker style (``input_ids``, ``mask``, queries, evidence documents)
plus ``stats.json``. The test split is never read, and the test worlds' documents are left out of the
retriever: their entities, relations and phrasings stay unseen, even as distractors.

``--conversations`` writes multi-turn traces instead (``{split}-conversations-{variant}.jsonl``, from
``conversations-{split}.jsonl``; ``train/conversations.py``): every turn of every conversation,
once with and once without the evidence memory in the prompt. ``--cite`` adds the citing variant
(``{split}-conversations-cite-{variant}.jsonl``): the citation instruction in the system message and
answers that end with their document's number.

``--templates`` keeps only the traces of those question templates (``{split}-focus-{variant}.jsonl``;
every question is still built, in order, so each kept trace equals its twin in the full file): the
third training stage repeats the questions whose last hop is a city or a country. ``--kinds`` does
the same by question kind (``chain``, ``compare``, ``yesno``, ``no_retrieval``; the wide worlds'
records carry it), into ``{split}-kinds-{kind+kind}-{variant}.jsonl``: comparisons and yes/no
questions as a focus set. ``--balance-yes-no`` keeps no more yes/no traces answered "no" than "yes"
(the first in order; ``...-balanced-{variant}.jsonl``): the wide worlds ask about 60 % "no", and a
model trained on that answers "no" without reading the evidence. ``--one-search`` asks for both
entities of a comparison or two-chain yes/no question of one hop per chain in one search, so both
values stand in one evidence block (``...-onesearch-{variant}.jsonl``; ``TraceBuilder``).

``--held-out DIR`` drops every question that names an entity of another ``rig synth`` folder's dev or
test world (counted), so the train split of a second world (``rig synth --seed 1``) can add
questions without leaking the evaluation's names: the fourth training stage does this.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from rig_decode.config import ModelConfig, RetrieverConfig
from rig_decode.eval.datasets import load_dataset
from rig_decode.eval.synth import held_out_names
from rig_decode.models.loader import load_tokenizer
from rig_decode.prompt import MARKER_ADAPTER_PROMPT
from rig_decode.retrieval.factory import build_retriever
from rig_decode.train.conversations import ConversationTraceBuilder
from rig_decode.train.data import PATHS, Trace, TraceBuilder, training_corpus

KINDS = ("chain", "compare", "yesno", "no_retrieval")
"""Question kinds of the wide worlds' records (``eval/world_questions.py``)."""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--synth", required=True, help="folder written by `rig synth`")
    ap.add_argument("--out", required=True)
    ap.add_argument("--splits", default="train,dev")
    ap.add_argument("--variants", default="special,text,json",
                    help="special (delimiters as new tokens), text (as plain text), json (the JSON style)")
    ap.add_argument("--model", default=ModelConfig().name, help="whose tokenizer to use")
    ap.add_argument("--evidence-budget", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--conversations", action="store_true", help="multi-turn traces from conversations-{split}.jsonl")
    ap.add_argument("--cite", action="store_true", help="with --conversations: also the citing variant")
    ap.add_argument("--templates", help="comma-separated question templates: write only their traces (a focus set)")
    ap.add_argument("--kinds", help="comma-separated question kinds (chain, compare, yesno, no_retrieval): "
                                    "write only their traces (a focus set)")
    ap.add_argument("--balance-yes-no", action="store_true",
                    help='keep no more yes/no traces answered "no" than "yes" (the first in order)')
    ap.add_argument("--one-search", action="store_true",
                    help="one search naming both entities for comparisons and two-chain yes/no questions of one hop "
                         "per chain (both values in one evidence block)")
    ap.add_argument("--held-out", help="a `rig synth` folder whose dev/test entities must stay unseen: "
                                       "questions naming one are dropped")
    ap.add_argument("--system-prompt", default=MARKER_ADAPTER_PROMPT,
                    help="system message of every trace; the trained adapter records it and sessions use it")
    args = ap.parse_args(argv)
    synth, out = Path(args.synth), Path(args.out)
    if any(s.startswith("test") for s in args.splits.split(",")):
        ap.error("test splits are held out: their entities, phrasings and relations must stay unseen by training")
    focus = set(args.templates.split(",")) if args.templates else None
    if focus and args.conversations:
        ap.error("--templates selects single-turn questions; conversations have no templates")
    if focus and (unknown := focus - set(PATHS)):
        ap.error(f"unknown templates {sorted(unknown)} (known: {', '.join(PATHS)})")
    kinds = set(args.kinds.split(",")) if args.kinds else None
    if kinds and (unknown := kinds - set(KINDS)):
        ap.error(f"unknown kinds {sorted(unknown)} (known: {', '.join(KINDS)})")
    if kinds and focus:
        ap.error("--kinds and --templates are two ways to pick a focus set: give one")
    if (kinds or args.balance_yes_no or args.one_search) and args.conversations:
        ap.error("--kinds, --balance-yes-no and --one-search are about single-turn questions: not with --conversations")
    if args.held_out and not (Path(args.held_out) / "corpus.jsonl").is_file():
        ap.error(f"--held-out {args.held_out}: no corpus.jsonl there; give the folder `rig synth` wrote")
    held_out = held_out_names(args.held_out) if args.held_out else set()
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(ModelConfig(name=args.model))
    stats = {}
    retriever = None
    tag = "-focus" if focus else f"-kinds-{'+'.join(sorted(kinds))}" if kinds else ""
    tag += ("-balanced" if args.balance_yes_no else "") + ("-onesearch" if args.one_search else "")
    for split in args.splits.split(","):
        records = [json.loads(line) for line in (synth / f"{split}.jsonl").open(encoding="utf-8")]
        if held_out:
            kept = [r for r in records if not held_out.intersection(r.get("entities") or ())]
            print(f"{split}: {len(records) - len(kept)} of {len(records)} questions name a held-out entity "
                  f"of {args.held_out}: dropped", file=sys.stderr)
            records = kept
        if retriever is None:
            _, corpus = load_dataset(synth / f"{split}.jsonl")
            corpus = training_corpus(corpus)
            retriever = build_retriever(RetrieverConfig(), corpus=corpus)
        for variant in args.variants.split(","):
            if args.conversations:
                for cite in (False, True) if args.cite else (False,):
                    name = f"{split}-conversations{'-cite' if cite else ''}-{variant}"
                    stats[name] = _conversations(args, synth / f"conversations-{split}.jsonl", out / f"{name}.jsonl",
                                                 tok, retriever, variant, cite)
                continue
            builder = TraceBuilder(tok, retriever, variant, evidence_budget=args.evidence_budget,
                                   top_k=args.top_k, system_prompt=args.system_prompt, one_search=args.one_search,
                                   seed=args.seed)
            path = out / f"{split}{tag}-{variant}.jsonl"
            built = [(rec, builder.build(rec)) for rec in tqdm(records, desc=f"{split} {variant}", file=sys.stderr)]
            kept = select(built, focus, kinds, args.balance_yes_no)
            with path.open("w", encoding="utf-8") as f:
                for trace in kept:
                    f.write(json.dumps(trace.to_json(), ensure_ascii=False) + "\n")
            written = Counter(t.kind for t in kept)
            n = written.total()
            stats[path.stem] = {"built": builder.stats.built, "written": n, "skipped": builder.stats.skipped,
                                "kinds": dict(written)}
            print(f"{path}: wrote {n} of {builder.stats.built} traces built ({builder.stats.skipped} questions skipped), "
                  f"{dict(written)}", file=sys.stderr)
    name = "stats-conversations.json" if args.conversations else f"stats{tag}.json"
    (out / name).write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps({"marker_data": stats}))
    return 0


def select(built: list[tuple[dict, Trace | None]], templates: set[str] | None, kinds: set[str] | None,
           balance_yes_no: bool) -> list[Trace]:
    """The traces to write, in order: those built (a question no query supports has none), of the
    given templates and kinds; with ``balance_yes_no``, no more yes/no traces answered "no" than
    "yes" (the first ones)."""
    kept = [(rec, t) for rec, t in built if t is not None and (not templates or rec.get("template") in templates)
            and (not kinds or rec.get("kind") in kinds)]
    if not balance_yes_no:
        return [t for _, t in kept]
    room = sum(rec.get("kind") == "yesno" and rec["answer"] == "yes" for rec, _ in kept)  # "no" traces to keep
    out = []
    for rec, t in kept:
        if rec.get("kind") == "yesno" and rec["answer"] == "no":
            if room == 0:
                continue
            room -= 1
        out.append(t)
    return out


def _conversations(args, src: Path, path: Path, tok, retriever, variant: str, cite: bool) -> dict:
    builder = ConversationTraceBuilder(tok, retriever, variant, evidence_budget=args.evidence_budget,
                                       top_k=args.top_k, system_prompt=args.system_prompt, seed=args.seed)
    convs = [json.loads(line) for line in src.open(encoding="utf-8") if line.strip()]
    with path.open("w", encoding="utf-8") as f:
        for conv in tqdm(convs, desc=f"{src.name} {variant}", file=sys.stderr):
            for with_memory in (False, True):
                for trace in builder.build(conv, with_memory, cite):
                    f.write(json.dumps(trace.to_json(), ensure_ascii=False) + "\n")
    print(f"{path}: {builder.stats.built} traces, {builder.stats.skipped} conversations skipped, "
          f"{builder.stats.kinds}", file=sys.stderr)
    return {"built": builder.stats.built, "skipped": builder.stats.skipped, "kinds": builder.stats.kinds}


if __name__ == "__main__":
    sys.exit(main())
