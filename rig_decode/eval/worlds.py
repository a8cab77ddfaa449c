"""Wide synthetic worlds: a multi-hop benchmark as wide as the skill, with splits that measure
transfer (``rig synth --generator wide``).

A world holds entities of nine kinds (people, companies, products, cities, countries, projects,
books, events, institutions) and 40 relations among them and to values (years, counts, amounts,
titles, currencies; ``world_schema.py``). Each entity has one document stating its facts, each
fact in one of several phrasings (active, passive, object first, apposition, two facts in one
sentence, a look-alike entity's fact beside it). Distractors are built in: companies come in
families sharing a base name, products in families sharing a brand, people in families sharing a
surname, and an "unlike X" sentence names a sibling with its own value.

Questions:

* chains of 1-4 relations, composed wherever a relation's object kind is the next one's subject
  kind ("What is the birthplace of the founder of the maker of Zentor X5?"), in many phrasings;
* comparisons of a numeric attribute over two chains ("Which company has the earlier founding
  year, the maker of A or the maker of B?") and yes/no questions (same value? this value?);
* questions that need no search (common knowledge, arithmetic), from lists disjoint across splits.

Splits are separate worlds with disjoint names. ``train`` and ``dev`` and ``test`` (unseen
entities) share the training relations and phrasings; ``test_phrasings`` writes its documents and
questions only in held-out phrasings; ``test_relations`` chains through relations no training
world has; ``test_mixed`` does both. One corpus holds every world's documents.

Each question carries its ``plan``: per hop the entity, its document and three query phrasings,
which trace building (``train/data.py``) sends to the real retriever.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

from .world_questions import world_questions
from .world_schema import (EVERY_FACT_FRAME, EXTRA_COMMON, EXTRA_FACT_FRAMES, EXTRA_QUESTION_FRAMES, FACT_FRAMES,
                           HELD_OUT_FACT_FRAMES, HELD_OUT_QUESTION_FRAMES, HELD_OUT_RELATIONS, INTRO, QUESTION_FRAMES,
                           RELATION, RELATIONS, ROLES, Relation, capitalised, doc_id)

_TRAIN_RELATIONS = tuple(r.name for r in RELATIONS if r.name not in HELD_OUT_RELATIONS)
_ALL_RELATIONS = tuple(r.name for r in RELATIONS)
_TRAIN_FACTS = tuple(f for f in FACT_FRAMES if f not in HELD_OUT_FACT_FRAMES)
_TRAIN_QUESTIONS = tuple(f for f in QUESTION_FRAMES if f not in HELD_OUT_QUESTION_FRAMES)


@dataclass(frozen=True, slots=True)
class SplitSpec:
    name: str
    relations: tuple[str, ...]
    fact_frames: tuple[str, ...]
    question_frames: tuple[str, ...]
    must_use: tuple[str, ...] = ()
    """A question's chain uses at least one of these relations (the unseen-relation splits)."""
    common: str = "test"
    common_extra: tuple[tuple[str, str], ...] = ()
    """More questions that need no search, beside the ``common`` list's (training worlds only)."""
    units: int = 3
    unseen_phrasings: bool = False


SPLITS = (
    SplitSpec("train", _TRAIN_RELATIONS, _TRAIN_FACTS, _TRAIN_QUESTIONS, common="train", units=10),
    SplitSpec("dev", _TRAIN_RELATIONS, _TRAIN_FACTS, _TRAIN_QUESTIONS, common="dev", units=2),
    SplitSpec("test", _TRAIN_RELATIONS, _TRAIN_FACTS, _TRAIN_QUESTIONS),
    SplitSpec("test_phrasings", _TRAIN_RELATIONS, HELD_OUT_FACT_FRAMES, HELD_OUT_QUESTION_FRAMES,
              unseen_phrasings=True),
    SplitSpec("test_relations", _ALL_RELATIONS, _TRAIN_FACTS, _TRAIN_QUESTIONS, HELD_OUT_RELATIONS),
    SplitSpec("test_mixed", _ALL_RELATIONS, HELD_OUT_FACT_FRAMES, HELD_OUT_QUESTION_FRAMES, HELD_OUT_RELATIONS,
              unseen_phrasings=True),
)
PER_TYPE = {0: 30, 1: 70, 2: 70, 3: 50, 4: 30, "compare": 25, "yesno": 25}
"""Questions of a test split by hop count (chains) and type; 300 in all, scaled by ``units``."""

_ONSETS = ["b", "ch", "d", "f", "h", "j", "k", "l", "m", "n", "p", "q", "r", "s", "sh", "t", "v", "w", "y", "z",
           "bl", "fr", "gr", "pl", "sk", "sn", "th", "tw"]
_VOWELS = ["a", "e", "i", "o", "u", "ea", "io", "au", "ei"]
_CODAS = ["", "", "", "m", "n", "r", "s", "x", "nd", "lt"]
_COMPANY_SUFFIXES = ("Group", "Corporation", "Partners", "Technologies", "Foundry", "Collective", "Networks")
_CURRENCY_UNITS = ("crown", "mark", "real", "florin", "shekel")


class Names:
    """Pronounceable words, none used twice across one benchmark's worlds."""

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set()

    def word(self, syllables: int = 2) -> str:
        while True:
            w = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(syllables))
            w = (w + self.rng.choice(_CODAS)).capitalize()
            if w not in self.used and 4 <= len(w) <= 11:
                self.used.add(w)
                return w


@dataclass(slots=True)
class World:
    split: str
    kinds: dict[str, str] = field(default_factory=dict)  # entity -> kind
    facts: dict[str, dict[str, str]] = field(default_factory=dict)  # entity -> relation -> object
    family: dict[str, str] = field(default_factory=dict)  # entity -> its family (look-alikes share one)
    docs: dict[str, dict] = field(default_factory=dict)

    def of_kind(self, kind: str) -> list[str]:
        return [e for e, k in self.kinds.items() if k == kind]


def _entities(names: Names, rng: random.Random, u: int) -> list[tuple[str, str, str]]:
    """(name, kind, family) for a world of ``u`` units."""
    out = []
    for _ in range(2 + u):
        out.append((names.word(2) + rng.choice(("ia", "land", "ova", "ar")), "country", ""))
    for _ in range(5 * u):
        out.append((names.word(2), "city", ""))
    for _ in range(3 * u):  # families share a surname
        last = names.word(2)
        out += [(f"{names.word(2)} {last}", "person", last) for _ in range(rng.choice((2, 3)))]
    for _ in range(2 * u):
        base = names.word(3)
        out += [(f"{base} {s}", "company", base) for s in rng.sample(_COMPANY_SUFFIXES, 2)]
    for _ in range(2 * u):
        brand, letter, num = names.word(2), rng.choice("ACHJLMPQSW"), rng.randint(2, 8)
        out += [(f"{brand} {m}", "product", brand) for m in (f"{letter}{num}", f"{letter}{num}0", f"{letter}{num + 1}")]
    for _ in range(u):
        out.append((f"Project {names.word(2)}", "project", ""))
        out.append((f"{names.word(2)} Initiative", "project", ""))
        out.append((f"Echoes of {names.word(2)}", "work", ""))
        out.append((f"The {names.word(2)} Letters", "work", ""))
        out.append((f"{names.word(2)} Summit", "event", ""))
        out.append((f"{names.word(2)} Festival", "event", ""))
        out.append((f"University of {names.word(2)}", "institution", ""))
        out.append((f"{names.word(2)} Institute of Technology", "institution", ""))
    return out


def _value(rel: Relation, rng: random.Random, names: Names) -> str:
    years = {"birth_year": (1940, 1996), "founding_year": (1890, 2016), "release_year": (1995, 2025),
             "publication_year": (1950, 2025), "start_year": (2000, 2025), "first_year": (1960, 2021),
             "established": (1850, 2001)}
    if rel.object == "year":
        return str(rng.randrange(*years[rel.name]))
    if rel.object == "number":
        lo, hi = {"staff": (40, 90_000), "population": (8_000, 2_500_000), "pages": (90, 900),
                  "attendance": (300, 80_000)}[rel.name]
        return f"{rng.randint(lo, hi):,}"
    if rel.object == "amount":
        if rel.name == "price":
            return f"${rng.randint(19, 2_999)}"
        return f"${rng.randint(1, 99)}.{rng.randint(1, 9)} million"
    if rel.object == "role":
        return rng.choice(ROLES)
    return f"the {names.word(2)} {rng.choice(_CURRENCY_UNITS)}"


def build_world(spec: SplitSpec, names: Names, rng: random.Random, u: int) -> World:
    w = World(spec.name)
    for name, kind, family in _entities(names, rng, u):
        w.kinds[name], w.facts[name], w.family[name] = kind, {}, family
    rels = [RELATION[r] for r in spec.relations]
    for e, kind in w.kinds.items():
        for rel in (r for r in rels if r.subject == kind):
            if rel.is_link:
                pool = [x for x in w.of_kind(rel.object) if x != e]
                if pool:
                    w.facts[e][rel.name] = rng.choice(pool)
            else:
                w.facts[e][rel.name] = _value(rel, rng, names)
    for e, kind in w.kinds.items():
        w.docs[doc_id(kind, e)] = {"id": doc_id(kind, e), "title": e, "text": _describe(w, e, spec, rng),
                                   "metadata": {"kind": kind, "split": spec.name}}
    return w


def _describe(w: World, e: str, spec: SplitSpec, rng: random.Random) -> str:
    """The entity's document: an introduction, then each fact in one of the split's phrasings."""
    kind = w.kinds[e]
    facts = list(w.facts[e].items())
    rng.shuffle(facts)
    sentences = [rng.choice(INTRO[kind]).format(e=e)]
    while facts:
        name, o = facts.pop()
        rel = RELATION[name]
        frame = rng.choice(spec.fact_frames)
        two = frame in ("two_facts", "whose")
        if two and not facts:
            frame = rng.choice([f for f in spec.fact_frames if f not in ("two_facts", "whose")] or ["plain"])
            two = False
        slots = {"s": e, "o": o, "pred": rel.pred.format(o=o), "noun": rel.noun,
                 "inv_cap": capitalised(rel.inv.format(s=e, o=o))}
        if two:
            name2, o2 = facts.pop()
            slots["pred2"] = RELATION[name2].pred.format(o=o2)
        if frame == "unlike":
            others = [x for x in w.of_kind(kind) if x != e and name in w.facts[x]]
            siblings = [x for x in others if w.family[x] and w.family[x] == w.family[e]]
            if not others:
                frame = "plain"
            else:
                other = rng.choice(siblings or others)
                slots.update(other=other, other_pred=rel.pred.format(o=w.facts[other][name]))
        sentences.append(capitalised(EVERY_FACT_FRAME[frame].format(**slots)))
    return " ".join(sentences)


def generate(seed: int = 0, scale: float = 1.0, extra_phrasings: bool = False,
             extra_no_search: bool = False) -> tuple[list[dict], dict[str, list[dict]]]:
    """(corpus documents, questions per split); ``scale`` multiplies world sizes and counts.
    ``extra_phrasings`` gives the train and dev worlds the training-only phrasings too
    (``EXTRA_*_FRAMES``); ``extra_no_search`` adds the ``EXTRA_COMMON`` questions to the train
    world's questions that need no search; the test worlds' phrasings stay as they are (their worlds, drawn from the
    same random stream, differ: such a run adds training data, it is no benchmark)."""
    rng = random.Random(seed)
    names = Names(rng)
    corpus, splits = [], {}
    for spec in SPLITS:
        if extra_phrasings and not spec.name.startswith("test"):
            spec = replace(spec, fact_frames=spec.fact_frames + tuple(EXTRA_FACT_FRAMES),
                           question_frames=spec.question_frames + tuple(EXTRA_QUESTION_FRAMES))
        if extra_no_search and spec.name == "train":
            spec = replace(spec, common_extra=tuple(EXTRA_COMMON))
        u = max(1, round(spec.units * scale))
        w = build_world(spec, names, rng, u)
        corpus += list(w.docs.values())
        per_type = {k: max(1, round(n * u / 3)) for k, n in PER_TYPE.items()}
        splits[spec.name] = world_questions(w, spec, random.Random(f"{seed}-{spec.name}"), per_type)
    return corpus, splits


def write(out_dir: str | Path, seed: int = 0, scale: float = 1.0, extra_phrasings: bool = False,
          extra_no_search: bool = False) -> dict[str, int]:
    """Write ``corpus.jsonl`` and one ``<split>.jsonl`` per split (the eval dataset format)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus, splits = generate(seed, scale, extra_phrasings, extra_no_search)
    counts = {"documents": len(corpus)}
    with (out / "corpus.jsonl").open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(d, ensure_ascii=False) + "\n" for d in corpus)
    for name, qs in splits.items():
        with (out / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(q, ensure_ascii=False) + "\n" for q in qs)
        counts[name] = len(qs)
    return counts
