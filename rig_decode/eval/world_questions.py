"""Questions over a wide world (``worlds.py``): chains, comparisons, yes/no, and no-retrieval.

Every record is in the eval dataset format (``question``, ``answer``, ``hops``, ``supporting_docs``,
``needs_retrieval``) plus what trace building and per-type reports read: ``kind`` (chain | compare
| yesno | no_retrieval), ``template`` (the relation path, e.g. ``maker>founder>birthplace``),
``frame`` (the question phrasing), ``relations`` and ``plan`` (per hop: entity, document, query
phrasings; in the order a reader needs them).
"""

from __future__ import annotations

import random

from .world_schema import (ARITHMETIC, COMMON, EVERY_QUESTION_FRAME, KIND_WORD, RELATION, Relation, capitalised,
                           doc_id)

COMPARE_FRAMES = {
    "which_kind": "Which {kind} has the {adj} {noun}, {np_a} or {np_b}?",
    "between": "Between {np_a} and {np_b}, which has the {adj} {noun}?",
    "of_the_two": "Of {np_a} and {np_b}, which one has the {adj} {noun}?",
    "which_one": "Which one has the {adj} {noun}, {np_a} or {np_b}?",
    "colon": "{np_a_cap} or {np_b}: which has the {adj} {noun}?",
    "who_or_what": "Who or what has the {adj} {noun}: {np_a} or {np_b}?",
}
YESNO_FRAMES = {
    "is_value": "Is {value} the {noun} of {np}?",
    "is_the": "Is the {noun} of {np} {value}?",
    "true_that": "Is it true that the {noun} of {np} is {value}?",
    "same": "Do {np_a} and {np_b} have the same {noun}?",
    "equal": "Does the {noun} of {np} equal {value}?",
    "alike": "Are {np_a} and {np_b} alike in {noun}?",
}
HELD_OUT_COMPARE = ("colon", "who_or_what")
HELD_OUT_YESNO = ("equal", "alike")


def _poss(x: str) -> str:
    return x + ("'" if x.endswith("s") else "'s")


def noun_phrase(start: str, rels: list[Relation], possessive: bool = False) -> str:
    """``the founder of the maker of Zentor X5`` (or ``Zentor X5's maker's founder``)."""
    if possessive:
        np = start
        for r in rels:
            np = f"{_poss(np)} {r.noun}"
        return np
    np = start
    for r in rels:
        np = f"the {r.noun} of {np}"
    return np


def hop_plan(w, chain: list[str], rels: list[Relation]) -> list[dict]:
    """One step per hop: the entity whose document is read, the relation, the value it reads there
    (the next entity of a chain, or an attribute), and queries that find the document."""
    return [{"entity": e, "doc": doc_id(w.kinds[e], e), "relation": r.name, "value": w.facts[e][r.name],
             "queries": [f"{r.noun} of {e}", f"{e} {r.noun}", r.wh.format(x=e).rstrip("?")]}
            for e, r in zip(chain, rels)]


def _walk(w, spec, rng: random.Random, hops: int) -> tuple[list[str], list[Relation]] | None:
    active = set(spec.relations)
    start = rng.choice([e for e, f in w.facts.items() if f])
    chain, rels = [start], []
    for h in range(hops):
        options = [n for n in w.facts[chain[-1]] if n in active and (h == hops - 1 or RELATION[n].is_link)]
        if not options:
            return None
        r = RELATION[rng.choice(options)]
        rels.append(r)
        chain.append(w.facts[chain[-1]][r.name])
    if spec.must_use and not any(r.name in spec.must_use for r in rels):
        return None
    return chain, rels


def chain_question(w, spec, rng: random.Random, hops: int) -> dict | None:
    walked = _walk(w, spec, rng, hops)
    if walked is None:
        return None
    chain, rels = walked
    last = rels[-1]
    frame = rng.choice(spec.question_frames)
    np = noun_phrase(chain[0], rels[:-1])
    text = EVERY_QUESTION_FRAME[frame].format(noun=last.noun, np=np, kind=KIND_WORD[last.object],
                                         wh=last.wh.format(x=np), np_poss=_poss(noun_phrase(chain[0], rels[:-1], True)))
    return _record(w, capitalised(text), chain[-1], "chain", ">".join(r.name for r in rels), frame, chain[:-1], rels)


def _number(value: str) -> float:
    v = value.replace("$", "").replace(",", "")
    return float(v.split()[0]) * (1e6 if v.endswith("million") else 1.0)


def _pair(w, spec, rng: random.Random, attribute: bool, same: bool | None = None):
    """Two chains ending in one relation: (prefix relation or None, [a0, a], [b0, b], relation)."""
    active = [RELATION[n] for n in spec.relations]
    finals = [r for r in active if (r.object in ("year", "number", "amount")) == attribute and (attribute or r.is_link)]
    r = rng.choice(finals)
    prefixes = [p for p in active if p.is_link and p.object == r.subject]
    prefix = rng.choice(prefixes) if prefixes and rng.random() < 0.5 else None
    starts = [e for e in w.facts if (prefix.name if prefix else r.name) in w.facts[e]]
    ends = lambda e: w.facts[e][prefix.name] if prefix else e  # noqa: E731
    starts = [e for e in starts if r.name in w.facts[ends(e)]]
    if len(starts) < 2:
        return None
    for _ in range(20):
        a0, b0 = rng.sample(starts, 2)
        a, b = ends(a0), ends(b0)
        va, vb = w.facts[a][r.name], w.facts[b][r.name]
        if a == b or (attribute and _number(va) == _number(vb)) or (same is not None and (va == vb) != same):
            continue
        if spec.must_use and not any(x and x.name in spec.must_use for x in (prefix, r)):
            return None
        return prefix, [a0, a], [b0, b], r
    return None


def compare_question(w, spec, rng: random.Random) -> dict | None:
    pair = _pair(w, spec, rng, attribute=True)
    if pair is None:
        return None
    prefix, (a0, a), (b0, b), r = pair
    pre = [prefix] if prefix else []
    earlier = rng.random() < 0.5
    adj = ("earlier" if earlier else "later") if r.object == "year" else ("smaller" if earlier else "larger")
    va, vb = _number(w.facts[a][r.name]), _number(w.facts[b][r.name])
    answer = a if (va < vb) == earlier else b
    frames = [f for f in COMPARE_FRAMES if (f in HELD_OUT_COMPARE) == spec.unseen_phrasings]
    frame = rng.choice(frames)
    np_a, np_b = noun_phrase(a0, pre), noun_phrase(b0, pre)
    text = COMPARE_FRAMES[frame].format(kind=KIND_WORD[r.subject], adj=adj, noun=r.noun, np_a=np_a, np_b=np_b,
                                        np_a_cap=capitalised(np_a))
    chain = ([a0] if prefix else []) + [a] + ([b0] if prefix else []) + [b]
    rels = (pre + [r]) * 2
    return _record(w, text, answer, "compare", f"compare:{'>'.join(x.name for x in pre + [r])}", frame, chain, rels)


def yesno_question(w, spec, rng: random.Random) -> dict | None:
    two = rng.random() < 0.5
    frames = [f for f in YESNO_FRAMES if (f in HELD_OUT_YESNO) == spec.unseen_phrasings and (f in ("same", "alike")) == two]
    frame = rng.choice(frames)
    if two:
        pair = _pair(w, spec, rng, attribute=False, same=rng.random() < 0.5)
        if pair is None:
            return None
        prefix, (a0, a), (b0, b), r = pair
        pre = [prefix] if prefix else []
        answer = "yes" if w.facts[a][r.name] == w.facts[b][r.name] else "no"
        text = YESNO_FRAMES[frame].format(np_a=noun_phrase(a0, pre), np_b=noun_phrase(b0, pre), noun=r.noun)
        chain = ([a0] if prefix else []) + [a] + ([b0] if prefix else []) + [b]
        return _record(w, capitalised(text), answer, "yesno", f"same:{'>'.join(x.name for x in pre + [r])}", frame,
                       chain, (pre + [r]) * 2)
    walked = _walk(w, spec, rng, rng.choice((1, 2)))
    if walked is None:
        return None
    chain, rels = walked
    truth, last = chain[-1], rels[-1]
    decoys = [f[last.name] for e, f in w.facts.items() if last.name in f and f[last.name] != truth]
    if not decoys:
        return None
    yes = rng.random() < 0.5
    value = truth if yes else rng.choice(decoys)
    text = YESNO_FRAMES[frame].format(value=value, noun=last.noun, np=noun_phrase(chain[0], rels[:-1]))
    return _record(w, capitalised(text), "yes" if yes else "no", "yesno", ">".join(r.name for r in rels), frame,
                   chain[:-1], rels)


def no_retrieval_questions(spec, rng: random.Random, n: int) -> list[dict]:
    common = [*COMMON[spec.common], *spec.common_extra]
    rng.shuffle(common)
    template, op = ARITHMETIC[spec.common]
    out, asked = [], set()
    while len(out) < n:
        if len(out) % 2 == 0 and common:
            q, a = common.pop()
        else:
            x, y = rng.randint(12, 60), rng.randint(2, 11)
            q, a = template.format(a=x, b=y), str(op(x, y))
        if q in asked:
            continue
        asked.add(q)
        out.append({"question": q, "answer": a, "hops": 0, "supporting_docs": [], "needs_retrieval": False,
                    "kind": "no_retrieval", "template": "no_retrieval", "frame": "", "relations": [], "plan": []})
    return out


def _record(w, question: str, answer: str, kind: str, template: str, frame: str, chain: list[str],
            rels: list[Relation]) -> dict:
    plan = hop_plan(w, chain, rels)
    return {"question": question, "answer": answer, "hops": len(plan), "supporting_docs": [p["doc"] for p in plan],
            "needs_retrieval": True, "kind": kind, "template": template, "frame": frame,
            "relations": [r.name for r in rels], "entities": chain, "plan": plan}


def world_questions(w, spec, rng: random.Random, per_type: dict) -> list[dict]:
    """About ``per_type`` questions of each hop count (0-4) and type (compare, yesno), no two
    alike; fewer where the world cannot make that many."""
    makers = {"compare": lambda: compare_question(w, spec, rng), "yesno": lambda: yesno_question(w, spec, rng)}
    out, seen = [], set()
    for key, n in per_type.items():
        if key == 0:
            out += no_retrieval_questions(spec, rng, n)
            continue
        make = makers.get(key) or (lambda h=key: chain_question(w, spec, rng, h))
        got, tries = 0, 0
        while got < n and tries < 200 * n:
            tries += 1
            q = make()
            if q is None or q["question"] in seen:
                continue
            seen.add(q["question"])
            out.append(q)
            got += 1
    rng.shuffle(out)
    for i, q in enumerate(out):
        q["id"] = f"{w.split}-{i:04d}"
        q["split"] = w.split
    return out
