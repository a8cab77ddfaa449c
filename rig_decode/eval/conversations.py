"""Multi-turn evaluation: how much retrieval conversations need, with and without memory and gate.

Each synthetic conversation is a lookup, a clarification that repeats it (its answer is already in
context), a detail about the entity looked up (the lookup's document holds it), a follow-up about the
entity just found (a new document), and chit-chat. Turn k of every conversation runs
as one batch, then turn k + 1 with the answers appended to the chats. Methods:

    rig                  every marker the model writes is searched
    rig+memory           evidence memory: earlier turns' documents in the prompt, near-duplicate
                         queries answered from them (``rig.reuse_similarity``)
    rig+memory+gate      plus the retrieval gate (``rig.gate``, enabled with its configured settings)

Metrics: searches per conversation; the redundant-retrieval rate, the share of turns that searched
although they need no document or only documents an earlier turn of the conversation retrieved
(clarifications, chit-chat, details whose lookup found its document); accuracy over turns that have an answer, citation validity and
support (when ``rig.citations`` is on).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tqdm.auto import tqdm

from ..engine.engine import RigEngine
from ..gate import settings_from_config
from ..markers import MarkerSpec
from ..memory import EvidenceMemory
from ..prompt import build_prompt
from ..session import engine_options
from . import metrics as M

METHODS = ("rig", "rig+memory", "rig+memory+gate")


def load_conversations(path: str | Path, limit: int | None = None) -> list[dict]:
    out = []
    for n, line in enumerate(Path(path).open(encoding="utf-8"), 1):
        if not line.strip():
            continue
        try:
            conv = json.loads(line)
            turns = conv["turns"]
            if not turns or any("question" not in t for t in turns):
                raise KeyError("question")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not a conversation record ({type(e).__name__}: {e})") from None
        out.append(conv)
    return out[:limit] if limit else out


def run_conversations(config, model, tokenizer, retriever, conversations: list[dict], methods: list[str],
                      batch_size: int = 16, progress: bool = True) -> dict[str, dict]:
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown conversation method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    spec, system = MarkerSpec.from_style(config.rig.marker_style), config.system_prompt()
    results = {}
    for method in methods:
        memory_on, gate_on = "memory" in method, method.endswith("gate")
        opts = engine_options(config, model, max_batch_size=batch_size,
                              reuse_similarity=(config.rig.reuse_similarity or 0.8) if memory_on else None,
                              gate=settings_from_config(config.rig.gate) if gate_on else None)
        engine = RigEngine(model, tokenizer, retriever, opts)
        chats = [[] for _ in conversations]
        memories = [EvidenceMemory() if memory_on else None for _ in conversations]
        records, t0 = [], time.perf_counter()
        turns = max(len(c["turns"]) for c in conversations)
        bar = tqdm(total=sum(len(c["turns"]) for c in conversations), desc=f"{method:>16}", unit="turn",
                   disable=not progress)
        for k in range(turns):
            live = [i for i, c in enumerate(conversations) if k < len(c["turns"])]
            seqs = []
            for i in live:
                turn = conversations[i]["turns"][k]
                chats[i].append({"role": "user", "content": turn["question"]})
                mem = memories[i]
                ids = build_prompt(tokenizer, chats[i], spec, system, mem.prompt_text() if mem else "")
                seqs.append(engine.new_sequence(ids, seq_id=i, question=turn["question"], memory=mem))
            engine.generate(seqs)
            for i, seq in zip(live, seqs):
                turn, answer = conversations[i]["turns"][k], seq.answer_text.strip()
                # the engine told the memory this turn's documents when the turn finished
                chats[i].append({"role": "assistant", "content": answer})
                records.append(_record(conversations[i]["id"], k, turn, answer, seq.trace))
            bar.update(len(live))
        bar.close()
        engine.close()
        results[method] = {"records": records, "wall_s": time.perf_counter() - t0}
    return results


def _record(conv_id: str, k: int, turn: dict, answer: str, trace) -> dict:
    steps = trace.retrieval_steps
    cites = trace.citations  # checked by the engine when the turn finished
    answers = turn.get("answers") or []
    return {"conversation": conv_id, "turn": k, "kind": turn.get("kind", ""), "question": turn["question"],
            "answers": answers, "prediction": answer, "needs_retrieval": turn.get("needs_retrieval"),
            "supporting_docs": list(turn.get("supporting_docs") or []),
            "accuracy": M.contains_answer(answer, answers) if answers else None,
            "hops": len(steps), "searches": sum(1 for s in steps if "reuse" not in s.info),
            "reused": sum(1 for s in steps if "reuse" in s.info),
            "vetoes": sum(1 for d in trace.gate if d["action"] == "veto"),
            "citations": len(cites), "citations_valid": sum(c["valid"] for c in cites),
            "citations_supported": sum(c["supported"] for c in cites), "trace": trace.to_dict()}


def redundant_turns(records: list[dict]) -> list[dict]:
    """The turns for which a search is redundant: they need no document, or only documents an earlier
    turn of the same conversation retrieved (searched or reused)."""
    seen: dict[str, set[str]] = {}
    out = []
    for r in sorted(records, key=lambda r: (r["conversation"], r["turn"])):
        had = seen.setdefault(r["conversation"], set())
        if r["needs_retrieval"] is False or (r.get("supporting_docs") and set(r["supporting_docs"]) <= had):
            out.append(r)
        had.update(d["id"] for st in r["trace"]["retrieval_steps"] for d in st["docs"])
    return out


def aggregate(records: list[dict]) -> dict:
    convs = {r["conversation"] for r in records}
    by_kind = lambda kind: [r for r in records if r["kind"] == kind]  # noqa: E731
    searched = lambda rs: M.mean([float(r["searches"] > 0) for r in rs])  # noqa: E731
    answered = [r["accuracy"] for r in records if r["accuracy"] is not None]
    cites = sum(r["citations"] for r in records)
    valid = sum(r["citations_valid"] for r in records)
    return {
        "conversations": len(convs), "turns": len(records),
        "searches_per_conversation": sum(r["searches"] for r in records) / len(convs) if convs else None,
        "reused_hops_per_conversation": sum(r["reused"] for r in records) / len(convs) if convs else None,
        "redundant_retrieval_rate": searched(redundant_turns(records)),
        "clarification_retrieval_rate": searched(by_kind("clarification")),
        "detail_retrieval_rate": searched(by_kind("detail")),
        "chit_chat_retrieval_rate": searched(by_kind("chit_chat")),
        "accuracy": M.mean(answered),
        "accuracy_by_kind": {k: M.mean([r["accuracy"] for r in by_kind(k) if r["accuracy"] is not None])
                             for k in ("lookup", "clarification", "detail", "follow_up")},
        "citation_validity": valid / cites if cites else None,
        "citation_support_rate": sum(r["citations_supported"] for r in records) / valid if valid else None,
    }


def table(summary: dict[str, dict]) -> str:
    """The methods side by side, then each method's change in searches and accuracy against ``rig``."""
    cols = ["searches_per_conversation", "redundant_retrieval_rate", "chit_chat_retrieval_rate", "accuracy",
            "citation_validity", "citation_support_rate"]
    head = "| method | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols) + "\n"
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    rows = "".join(f"| {m} | " + " | ".join(fmt(s[c]) for c in cols) + " |\n" for m, s in summary.items())
    base = summary.get("rig")
    if not base or not base["searches_per_conversation"] or base["accuracy"] is None:
        return head + rows
    vs = "".join(
        f"{m} vs rig: searches {100 * (s['searches_per_conversation'] / base['searches_per_conversation'] - 1):+.1f}%, "
        f"accuracy {100 * (s['accuracy'] - base['accuracy']):+.1f} points\n"
        for m, s in summary.items() if m != "rig" and s["accuracy"] is not None)
    return head + rows + ("\n" + vs if vs else "")
