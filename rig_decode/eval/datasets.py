"""Evaluation datasets: our JSONL format, and HotpotQA/2Wiki-style records with context paragraphs.

JSONL, one question per line::

    {"id": "q1", "question": "...", "answer": "..." | "answers": ["...", ...],
     "supporting_docs": ["doc id", ...], "needs_retrieval": true, "hops": 2}

Only ``question`` and ``answer``/``answers`` are required. A ``corpus.jsonl`` beside the dataset
(documents as ``rig index`` reads them) is used as the retrieval corpus unless one is given.

HotpotQA-style records (``.json`` list or ``.jsonl``) have ``context: [[title, [sentence, ...]],
...]`` and ``supporting_facts: [[title, sentence_index], ...]``: their paragraphs, deduplicated by
title across all records, become the corpus of the run, and the supporting titles the gold ids.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..retrieval.base import Document
from ..retrieval.ingest import load_documents


class DatasetError(ValueError):
    pass


@dataclass(slots=True)
class EvalExample:
    id: str
    question: str
    answers: list[str]
    supporting_docs: list[str] = field(default_factory=list)
    needs_retrieval: bool | None = None
    hops: int | None = None


def _records(path: Path) -> list[tuple[int, object]]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(data, list):
            raise DatasetError(f"{path}: expected a JSON list of records")
        return list(enumerate(data, 1))
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{n}: invalid JSON ({e.msg})") from None
    return out


def _string_list(rec: dict, key: str, where: str) -> list[str]:
    val = rec.get(key, [])
    if not isinstance(val, list) or not all(isinstance(x, str) for x in val):
        raise DatasetError(f"{where}: field {key!r} must be a list of strings")
    return val


def _example(rec: object, where: str, index: int) -> EvalExample:
    if not isinstance(rec, dict):
        raise DatasetError(f"{where}: expected an object, got {type(rec).__name__}")
    q = rec.get("question")
    if not isinstance(q, str) or not q.strip():
        raise DatasetError(f"{where}: field 'question' must be a non-empty string")
    if "answers" in rec:
        answers = _string_list(rec, "answers", where)
    elif isinstance(rec.get("answer"), str):
        answers = [rec["answer"]]
    else:
        raise DatasetError(f"{where}: needs 'answer' (a string) or 'answers' (a list of strings)")
    if not answers or not all(a.strip() for a in answers):
        raise DatasetError(f"{where}: answers must be non-empty strings")
    needs = rec.get("needs_retrieval")
    if needs is not None and not isinstance(needs, bool):
        raise DatasetError(f"{where}: field 'needs_retrieval' must be true or false")
    hops = rec.get("hops")
    if hops is not None and (not isinstance(hops, int) or hops < 0):
        raise DatasetError(f"{where}: field 'hops' must be a non-negative integer")
    ex_id = rec.get("id", rec.get("_id", str(index)))
    return EvalExample(str(ex_id), q.strip(), answers, [], needs, hops)


def _hotpot(rec: dict, ex: EvalExample, where: str, corpus: dict[str, Document]) -> None:
    ctx, facts = rec.get("context"), rec.get("supporting_facts")
    if not isinstance(ctx, list) or not isinstance(facts, list):
        raise DatasetError(f"{where}: 'context' and 'supporting_facts' must be lists")
    for item in ctx:
        if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str)
                or not isinstance(item[1], list)):
            raise DatasetError(f"{where}: each context entry must be [title, [sentence, ...]]")
        title, sentences = item
        corpus.setdefault(title, Document(title, " ".join(s.strip() for s in sentences), title))
    gold = []
    for f in facts:
        if not isinstance(f, list) or not f or not isinstance(f[0], str):
            raise DatasetError(f"{where}: each supporting fact must be [title, sentence_index]")
        if f[0] not in gold:
            gold.append(f[0])
    ex.supporting_docs = gold
    ex.needs_retrieval = True
    ex.hops = len(gold)


def load_dataset(path: str | Path, limit: int | None = None) -> tuple[list[EvalExample], list[Document] | None]:
    """(examples, corpus or None). The corpus comes from HotpotQA-style contexts or a sibling
    ``corpus.jsonl``; None means: use the configured retriever."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset not found: {path}")
    examples, corpus = [], {}
    hotpot = None
    for i, (n, rec) in enumerate(_records(path)):
        where = f"{path}:{n}" if path.suffix != ".json" else f"{path} record {n}"
        ex = _example(rec, where, i)
        is_hotpot = "context" in rec and "supporting_facts" in rec
        if hotpot is None:
            hotpot = is_hotpot
        elif hotpot != is_hotpot:
            raise DatasetError(f"{where}: mixes HotpotQA-style records with plain ones")
        if is_hotpot:
            _hotpot(rec, ex, where, corpus)
        else:
            ex.supporting_docs = _string_list(rec, "supporting_docs", where)
        examples.append(ex)
    if not examples:
        raise DatasetError(f"{path}: no examples")
    if limit:
        examples = examples[:limit]
    if hotpot:
        return examples, list(corpus.values())
    sibling = path.parent / "corpus.jsonl"
    if not sibling.is_file() or sibling == path:
        return examples, None
    corpus_docs = load_documents(sibling)
    ids = {d.doc_id for d in corpus_docs}
    if missing := sum(bool(set(ex.supporting_docs) - ids) for ex in examples):
        warnings.warn(f"{missing} of {len(examples)} questions of {path} name supporting documents that "
                      f"{sibling} does not hold: nothing can retrieve them (a dataset is evaluated over the "
                      "corpus.jsonl in its own folder)", stacklevel=2)
    return examples, corpus_docs
