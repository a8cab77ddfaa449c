"""The cases ``bench/zero_prefill_select.py`` measures on: held-out 1-hop questions of the synthetic
benchmark, each with the model's own query and an evidence block of the gold document among
documents of the same kind, and the ways of cutting that block into pieces computed apart."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from rig_decode.engine.runner_hf import common_prefix
from rig_decode.eval.synth import generate
from rig_decode.evidence import EvidenceFormatter
from rig_decode.markers import MarkerSpec
from rig_decode.prompt import MARKER_ADAPTER_PROMPT, build_prompt
from rig_decode.retrieval.base import Hit


@dataclass
class Case:
    context: list[int]  # prompt and query, up to the end marker
    block: list[int]
    segments: list[int]
    answers: list[str]
    documents: int  # in the block
    leads: list[list[int]]  # per piece (``EvidenceBlock.leads``)


def make_cases(tok, n: int, seed: int = 0, distractors: int = 3, gold_first: bool = True) -> list[Case]:
    """Held-out 1-hop questions with their gold document before ``distractors`` of the same kind
    (as a retriever ranks it), or at a random place among them; the query is filled in by
    ``write_queries``."""
    corpus, splits = generate(seed)
    docs = {d["id"]: d for d in corpus if d["metadata"]["split"] == "test"}
    rng = random.Random(seed)
    fmt = EvidenceFormatter(tok, budget=384)
    cases = []
    for q in [q for q in splits["test"] if q.hops == 1][:n]:
        gold = docs[q.supporting_docs[0]]
        kind = gold["metadata"]["kind"]
        others = rng.sample(sorted(i for i, d in docs.items() if d["metadata"]["kind"] == kind and i != gold["id"]),
                            distractors)
        picked = [docs[i] for i in others]
        picked.insert(0 if gold_first else rng.randrange(len(picked) + 1), gold)
        block = fmt.render_block([Hit(d["id"], d["text"], 1.0, d["title"]) for d in picked], hop=1)
        cases.append(Case(q.question, block.token_ids, block.segments, [q.answer], len(block.doc_ids), block.leads))
    return cases


def system_turn(tok, spec: MarkerSpec) -> list[int]:
    """The tokens every case's chat prompt starts with: its system turn and the user turn's header."""
    return common_prefix([build_prompt(tok, q, spec, system=MARKER_ADAPTER_PROMPT) for q in ("a?", "b?")])


@torch.no_grad()
def write_queries(model, tok, cases: list[Case], spec: MarkerSpec, max_query: int = 32) -> None:
    """Each case's context: its chat prompt, then the model's own query between the markers."""
    start, end = (tok.convert_tokens_to_ids(t[0]) for t in (spec.start, spec.end))
    for c in cases:
        ids = build_prompt(tok, c.context, spec, system=MARKER_ADAPTER_PROMPT) + [start]
        for _ in range(max_query):
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt == end:
                break
        if ids[-1] != end:
            ids.append(end)
        c.context = ids


def doc_pieces(case: Case, how: str) -> tuple[list[int], list[list[int]] | None]:
    """The block's pieces and their leads: as the engine has them (``lead``: a document's number
    alone, its text after ``[1]``), without the leads (``alone``), or each document's number and
    text as one piece (``line``)."""
    if how == "lead":
        return case.segments, case.leads
    if how == "alone":
        return case.segments, None
    segments = []
    for n, lead in zip(case.segments, case.leads):
        if lead:  # a document's text: one piece with its number before it
            segments[-1] += n
        else:
            segments.append(n)
    return segments, None
