"""A seeded synthetic multi-hop benchmark over a fictional world.

The world has products, companies, people, cities and countries, linked by relations::

    product --made by--> company --founded by--> person --born in--> city --in--> country
                         company --headquartered in--> city

Each entity has one short document stating its outgoing facts. Questions follow a chain of 0-3
relations, so a question needs exactly as many documents as it has hops, and its gold supporting
documents are the documents along the chain. Distractors are built in: products come in families
that share a brand and differ by one model number (Zentor X5, Zentor X50), companies share a base
name (Velora Dynamics, Velora Systems), and founding years and release years repeat. Questions that
need no retrieval (arithmetic, common knowledge) test that a model does not search when it need not.

Splits (train/dev/test) are separate worlds drawn from disjoint name pools: no entity of one split
appears in another. One corpus holds every split's documents, so other splits act as distractors.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..retrieval.ingest import load_documents

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "tr", "gl"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou"]
_CODAS = ["", "", "n", "r", "s", "l", "k", "th"]
_COMPANY_SUFFIXES = ["Dynamics", "Systems", "Labs", "Works", "Industries", "Holdings"]
_COUNTRY_SUFFIXES = ["ia", "land", "ania", "or"]
_COMMON = [
    ("What is the capital of France?", "Paris"),
    ("How many days are in a week?", "seven"),
    ("What color do you get by mixing blue and yellow?", "green"),
    ("What is the largest planet in the solar system?", "Jupiter"),
    ("How many legs does a spider have?", "eight"),
    ("What is the boiling point of water in degrees Celsius at sea level?", "100"),
    ("Which ocean lies between Europe and North America?", "Atlantic"),
    ("What gas do plants absorb from the air?", "carbon dioxide"),
    ("How many continents are there?", "seven"),
    ("What is the chemical symbol for gold?", "Au"),
    ("Who wrote Romeo and Juliet?", "Shakespeare"),
    ("How many minutes are in an hour?", "sixty"),
]


@dataclass(slots=True)
class SynthQuestion:
    id: str
    question: str
    answer: str
    hops: int
    supporting_docs: list[str]
    needs_retrieval: bool
    split: str
    template: str
    entities: list[str] = field(default_factory=list)


@dataclass(slots=True)
class World:
    split: str
    docs: dict[str, dict] = field(default_factory=dict)  # doc id -> {"id", "title", "text", "metadata"}
    facts: dict[str, dict[str, str]] = field(default_factory=dict)  # entity -> relation -> entity/value
    kinds: dict[str, str] = field(default_factory=dict)  # entity -> kind


class _Names:
    """Pronounceable names, never the same twice (across all splits of one benchmark)."""

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set()

    def word(self, syllables: int) -> str:
        while True:
            w = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(syllables))
            w = (w + self.rng.choice(_CODAS)).capitalize()
            if w not in self.used and len(w) > 3:
                self.used.add(w)
                return w


def _doc_id(kind: str, name: str) -> str:
    return f"{kind}:{name.lower().replace(' ', '-')}"


def build_world(split: str, names: _Names, rng: random.Random, *, countries: int = 4, cities: int = 10,
                people: int = 14, company_families: int = 6, product_families: int = 8) -> World:
    w = World(split)
    country_names = [names.word(2) + rng.choice(_COUNTRY_SUFFIXES) for _ in range(countries)]
    city_names = [names.word(2) for _ in range(cities)]
    person_names = [f"{names.word(2)} {names.word(2)}" for _ in range(people)]
    for c in country_names:
        w.kinds[c], w.facts[c] = "country", {}
    for c in city_names:
        w.kinds[c], w.facts[c] = "city", {"country": rng.choice(country_names)}
    for p in person_names:
        w.kinds[p], w.facts[p] = "person", {"birthplace": rng.choice(city_names)}
    companies = []
    for _ in range(company_families):  # distractor families: same base name, different suffix
        base = names.word(3)
        for suffix in rng.sample(_COMPANY_SUFFIXES, 2):
            c = f"{base} {suffix}"
            companies.append(c)
            w.kinds[c] = "company"
            w.facts[c] = {"founder": rng.choice(person_names), "hq": rng.choice(city_names),
                          "founded": str(rng.choice(range(1950, 2015, 3)))}
    for _ in range(product_families):  # same brand, model numbers one digit apart
        brand, letter = names.word(2), rng.choice("XKRTVZ")
        num = rng.randint(2, 9)
        for model in (f"{letter}{num}", f"{letter}{num}0", f"{letter}{num + 1}")[: rng.choice((2, 3))]:
            p = f"{brand} {model}"
            w.kinds[p] = "product"
            w.facts[p] = {"maker": rng.choice(companies), "released": str(rng.choice(range(1995, 2024, 2)))}
    for e, kind in w.kinds.items():
        w.docs[_doc_id(kind, e)] = {"id": _doc_id(kind, e), "title": e, "text": _describe(e, kind, w.facts[e]),
                                    "metadata": {"kind": kind, "split": split}}
    return w


def _describe(e: str, kind: str, f: dict[str, str]) -> str:
    if kind == "country":
        return f"{e} is a country."
    if kind == "city":
        return f"{e} is a city in {f['country']}."
    if kind == "person":
        return f"{e} is an engineer and entrepreneur who was born in {f['birthplace']}."
    if kind == "company":
        return f"{e} is a company headquartered in {f['hq']}. It was founded in {f['founded']} by {f['founder']}."
    return f"The {e} is a product made by {f['maker']}. It was released in {f['released']}."


# (template id, start kind, relation path, question text)
TEMPLATES = [
    ("maker", "product", ["maker"], "Which company makes the {e}?"),
    ("released", "product", ["released"], "In which year was the {e} released?"),
    ("hq", "company", ["hq"], "In which city is {e} headquartered?"),
    ("founder", "company", ["founder"], "Who founded {e}?"),
    ("birthplace", "person", ["birthplace"], "In which city was {e} born?"),
    ("maker_hq", "product", ["maker", "hq"], "In which city is the company that makes the {e} headquartered?"),
    ("maker_founder", "product", ["maker", "founder"], "Who founded the company that makes the {e}?"),
    ("founder_birthplace", "company", ["founder", "birthplace"], "In which city was the founder of {e} born?"),
    ("hq_country", "company", ["hq", "country"], "In which country is {e} headquartered?"),
    ("maker_founder_birthplace", "product", ["maker", "founder", "birthplace"],
     "In which city was the founder of the company that makes the {e} born?"),
    ("maker_hq_country", "product", ["maker", "hq", "country"],
     "In which country is the company that makes the {e} headquartered?"),
    ("founder_birthplace_country", "company", ["founder", "birthplace", "country"],
     "In which country was the founder of {e} born?"),
]


def world_questions(w: World, rng: random.Random, per_hop: dict[int, int]) -> list[SynthQuestion]:
    by_hop: dict[int, list[SynthQuestion]] = {1: [], 2: [], 3: []}
    for tid, kind, path, text in TEMPLATES:
        for e in (x for x, k in w.kinds.items() if k == kind):
            chain, cur = [e], e
            for rel in path:
                cur = w.facts[cur][rel]
                chain.append(cur)
            docs = [_doc_id(w.kinds[x], x) for x in chain[:-1]]
            q = SynthQuestion("", text.format(e=e), chain[-1], len(path), docs, True, w.split, tid, chain)
            by_hop[len(path)].append(q)
    out = []
    for hops, items in by_hop.items():
        rng.shuffle(items)
        out += items[: per_hop.get(hops, 0)]
    common = list(_COMMON)
    rng.shuffle(common)
    n0 = per_hop.get(0, 0)
    for i in range(n0):
        if i % 2 == 0 and common:
            q, a = common.pop()
        else:
            a_, b_ = rng.randint(2, 40), rng.randint(2, 40)
            q, a = f"What is {a_} plus {b_}?", str(a_ + b_)
        out.append(SynthQuestion("", q, a, 0, [], False, w.split, "no_retrieval"))
    rng.shuffle(out)
    for i, q in enumerate(out):
        q.id = f"{w.split}-{i:04d}"
    return out


_FOLLOW = {  # (relation of the answer entity to ask about next, question template)
    "company": [("hq", "And in which city is {e} headquartered?"), ("founder", "Who founded {e}, then?")],
    "person": [("birthplace", "Where was {e} born?")],
    "city": [("country", "Which country is {e} in?")],
}
_DETAIL = {  # lookup template -> (another relation of the same entity, question template)
    "maker": [("released", "And when was the {e} released?")],
    "hq": [("founder", "And who founded {e}?"), ("founded", "When was {e} founded?")],
    "founder": [("hq", "Where is {e} headquartered, then?"), ("founded", "When was {e} founded?")],
}
_CLARIFY = ["Sorry, what was the answer again?", "Can you repeat that?", "Just to confirm: what did you say it was?"]
_CHIT_CHAT = ["Thanks, that helps!", "Great, thank you.", "Hello! How are you today?", "Nice, that's all for now.",
              "You're very helpful.", "Good morning!"]
CONVERSATION_KINDS = ("lookup", "clarification", "detail", "follow_up", "chit_chat")


def world_conversations(w: World, rng: random.Random, n: int) -> list[dict]:
    """Multi-turn chats over a world, five turns each:

    * lookup: a 1-hop question (one search);
    * clarification: "can you repeat that?" (the answer is in the chat: no search);
    * detail: another fact of the entity looked up (the document the lookup retrieved holds it: a
      second search for it is redundant when that document is still at hand);
    * follow-up: a fact of the entity just found (needs one new document);
    * chit-chat (no search)."""
    starts = [(tid, kind, path, text) for tid, kind, path, text in TEMPLATES
              if len(path) == 1 and tid in _DETAIL]
    out = []
    for i in range(n):
        tid, kind, path, text = rng.choice(starts)
        e = rng.choice([x for x, k in w.kinds.items() if k == kind])
        found = w.facts[e][path[0]]
        follow_rel, follow_text = rng.choice(_FOLLOW[w.kinds[found]])
        detail_rel, detail_text = rng.choice(_DETAIL[tid])
        turns = [
            {"question": text.format(e=e), "answers": [found], "kind": "lookup",
             "supporting_docs": [_doc_id(kind, e)], "needs_retrieval": True},
            {"question": rng.choice(_CLARIFY), "answers": [found], "kind": "clarification",
             "supporting_docs": [_doc_id(kind, e)], "needs_retrieval": False},
            {"question": detail_text.format(e=e), "answers": [w.facts[e][detail_rel]], "kind": "detail",
             "supporting_docs": [_doc_id(kind, e)], "needs_retrieval": True},
            {"question": follow_text.format(e=found), "answers": [w.facts[found][follow_rel]], "kind": "follow_up",
             "supporting_docs": [_doc_id(w.kinds[found], found)], "needs_retrieval": True},
            {"question": rng.choice(_CHIT_CHAT), "answers": [], "kind": "chit_chat", "supporting_docs": [],
             "needs_retrieval": False},
        ]
        out.append({"id": f"conv-{w.split}-{i:04d}", "split": w.split, "turns": turns})
    return out


SPLIT_UNITS = {"train": 8, "dev": 2, "test": 3}
"""World size of each split; question counts scale with it (``per_hop`` is for the test split)."""


def generate(seed: int = 0, scale: float = 1.0, per_hop: dict[int, int] | None = None,
             conversations: dict[str, list[dict]] | None = None) -> tuple[list[dict], dict[str, list[SynthQuestion]]]:
    """(corpus documents, questions per split). ``scale`` multiplies world sizes and question
    counts; ``per_hop`` gives the test split's number of questions per hop count. A dict passed as
    ``conversations`` receives each split's multi-turn chats (drawn after the questions, so the
    questions do not depend on it)."""
    per_hop = per_hop or {0: 60, 1: 90, 2: 90, 3: 90}
    rng = random.Random(seed)
    names = _Names(rng)
    corpus: list[dict] = []
    splits: dict[str, list[SynthQuestion]] = {}
    for split, units in SPLIT_UNITS.items():
        u = max(1, round(units * scale))
        w = build_world(split, names, rng, countries=2 + u, cities=5 * u, people=6 * u,
                        company_families=3 * u, product_families=6 * u)
        corpus += list(w.docs.values())
        want = {h: round(n * scale * units / SPLIT_UNITS["test"]) for h, n in per_hop.items()}
        splits[split] = world_questions(w, rng, want)
        if conversations is not None:
            conversations[split] = world_conversations(w, random.Random(f"{seed}-{split}-conversations"),
                                                       round(40 * scale * units / SPLIT_UNITS["test"]))
    return corpus, splits


def write(out_dir: str | Path, seed: int = 0, scale: float = 1.0, per_hop: dict[int, int] | None = None) -> dict[str, int]:
    """Write ``corpus.jsonl`` and ``{train,dev,test}.jsonl`` (the eval dataset format)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    chats: dict[str, list[dict]] = {}
    corpus, splits = generate(seed, scale, per_hop, chats)
    with (out / "corpus.jsonl").open("w", encoding="utf-8") as f:
        for d in corpus:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    counts = {"documents": len(corpus)}
    for split, qs in splits.items():
        with (out / f"{split}.jsonl").open("w", encoding="utf-8") as f:
            for q in qs:
                f.write(json.dumps(asdict(q), ensure_ascii=False) + "\n")
        counts[split] = len(qs)
        with (out / f"conversations-{split}.jsonl").open("w", encoding="utf-8") as f:
            for c in chats[split]:
                f.write(json.dumps(c, ensure_ascii=False) + "\n")
        counts[f"conversations-{split}"] = len(chats[split])
    return counts


def held_out_names(out_dir: str | Path) -> set[str]:
    """Names of the entities of a ``rig synth`` folder's dev and test worlds (the titles of their
    documents): what training on another world must not mention."""
    return {d.title for d in load_documents(Path(out_dir) / "corpus.jsonl") if d.metadata["split"] != "train"}
