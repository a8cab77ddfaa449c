"""Supervised marker traces: what the model should write, with the evidence the decoder would splice.

For each synthetic question the builder writes the answer the way the decoder runs it:

    prompt | marker(query 1) | evidence 1 | marker(query 2) | evidence 2 | ... | answer <eos>

The queries are built from the question's entity chain (entity + relation, in a few phrasings);
each is sent to the *real* retriever and its hits are rendered by the decoder's own
``EvidenceFormatter``, so the evidence tokens in a trace are exactly what the engine would splice
for that query. The loss mask is the engine's mask: 1 on what the model writes (markers, queries,
answer, end of sequence), 0 on the prompt and the evidence.

Variations the model has to learn:

* no retrieval: questions any model knows (and arithmetic) are answered directly;
* re-query after misleading evidence: a vague first query (the name's first word) whose best hit
  is another entity (a sibling company, a neighbouring model number), then a precise one;
* re-query after an empty result: the decoder's no-evidence block (what a failed or empty search
  splices), then the query again in other words;
* one search for two values (``one_search``): a comparison or a two-chain yes/no question whose
  chains are one hop each asks for both entities at once ("budget of A and B"), so both values
  stand in one evidence block before the verdict; where no such search shows both, the question
  gets its two searches as usual.

A question whose precise queries never bring the needed document into the rendered evidence (a
long paragraph can be cut by the evidence budget; on a chain's last hop the answer must be in what
is shown) is skipped and counted, so no trace teaches an answer that its evidence does not support.

What the model writes (queries, answers) starts with a space (``spoken``), so names copied from
evidence keep the tokens they have there.
"""

from __future__ import annotations

import copy
import random
import sys
from dataclasses import dataclass, field

from ..eval.synth import TEMPLATES
from ..eval.world_schema import RELATION
from ..evidence import EvidenceFormatter, number_hits
from ..markers import MarkerSpec
from ..prompt import build_prompt
from ..retrieval.base import Retriever

PHRASINGS = {
    "maker": ["maker of the {e}", "{e} manufacturer", "which company makes the {e}"],
    "released": ["{e} release year", "when was the {e} released", "{e} released in"],
    "hq": ["{e} headquarters", "where is {e} headquartered", "{e} headquartered in"],
    "founder": ["founder of {e}", "who founded {e}", "{e} founded by"],
    "birthplace": ["{e} birthplace", "where was {e} born", "{e} born in"],
    "country": ["{e} country", "which country is {e} in", "city {e} located in country"],
}
PATHS = {tid: path for tid, _, path, _ in TEMPLATES}
VARIANTS = {"special": "special_token", "text": "special_token", "json": "json"}
"""Marker variants: ``special`` (the special_token style's delimiters added to the tokenizer as
single tokens), ``text`` (the same delimiters as plain text), ``json`` (the JSON style)."""


def hop_plan(q: dict) -> list[tuple[str, str, list[str]]]:
    """Per hop of a question record: (entity, the document it needs, query phrasings). Records of
    the wide worlds carry their ``plan``; those of ``eval/synth.py`` are planned from their
    template's relation path."""
    if q.get("plan"):
        return [(p["entity"], p["doc"], list(p["queries"])) for p in q["plan"]]
    path = PATHS[q["template"]]
    return [(q["entities"][h], q["supporting_docs"][h], [p.format(e=q["entities"][h]) for p in PHRASINGS[rel]])
            for h, rel in enumerate(path)]


def spoken(text: str) -> str:
    """``text`` as the model writes it: after a space. A byte-level BPE tokenizer splits a word at
    the start of a text differently from the same word after a space (``Sa|ibou`` vs ``ĠSa|ibou``),
    and in evidence names follow spaces; written like this, a name the model copies from evidence
    into a query or an answer is the same tokens in both places, not a re-spelling of an invented
    name (which a small model gets wrong: "Sausibou" for "Saibou"). The engine strips queries and
    answers, so the space never reaches a user."""
    return " " + text


def variant_tokenizer(tokenizer, variant: str):
    """The tokenizer a variant's traces are written with (a copy with the delimiters added, for
    ``special``; ``scripts/train_markers.py`` adds them to the model the same way)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown marker variant {variant!r} ({', '.join(VARIANTS)})")
    if variant != "special":
        return tokenizer
    tok = copy.deepcopy(tokenizer)
    spec = MarkerSpec.special_token()
    tok.add_tokens([spec.start[0], spec.end[0]], special_tokens=True)
    return tok


@dataclass(slots=True)
class Trace:
    id: str
    question: str
    answer: str
    hops: int
    style: str
    input_ids: list[int]
    mask: list[int]
    """1 = the model writes this token (trained on), 0 = prompt or evidence."""
    prompt_len: int
    queries: list[str] = field(default_factory=list)
    evidence_docs: list[list[str]] = field(default_factory=list)
    kind: str = "plain"
    """plain | no_retrieval | misleading_requery | empty_requery | one_search"""
    variant: str = "special"
    marker_token_ids: list[int] = field(default_factory=list)
    """The delimiters' token ids where they are single added tokens (``special`` variant)."""
    system_prompt: str | None = None
    """The system message of the prompt (None: the built-in marker instruction)."""

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


@dataclass(slots=True)
class BuildStats:
    built: int = 0
    skipped: int = 0
    kinds: dict[str, int] = field(default_factory=dict)


class TraceBuilder:
    def __init__(self, tokenizer, retriever: Retriever, variant: str = "special", *, evidence_budget: int = 256,
                 top_k: int = 3, system_prompt: str | None = None, p_misleading: float = 0.15,
                 p_empty: float = 0.05, one_search: bool = False, seed: int = 0):
        self.tok, self.retriever, self.variant = variant_tokenizer(tokenizer, variant), retriever, variant
        self.spec = MarkerSpec.from_style(VARIANTS[variant])
        self.marker_ids = (self.tok.convert_tokens_to_ids([self.spec.start[0], self.spec.end[0]])
                           if variant == "special" else [])
        self.formatter = EvidenceFormatter(tokenizer, evidence_budget)
        self.top_k, self.system = top_k, system_prompt
        self.p_misleading, self.p_empty, self.one_search = p_misleading, p_empty, one_search
        self.rng = random.Random(seed)
        self.stats = BuildStats()
        eos = self.tok.eos_token_id
        if eos is None:
            raise ValueError("the tokenizer has no EOS token; traces must teach the model to stop")
        self.eos = eos

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def _search(self, query: str) -> list:
        return list(self.retriever.search_batch([query], self.top_k)[0])

    @staticmethod
    def _shows(block, gold: str, answer: str | None) -> bool:
        """Whether a rendered block shows the gold document (a long paragraph past the evidence
        budget is cut or left out) and, where given, the answer in its shown text."""
        shown = dict(zip(block.doc_ids, block.shown))
        return gold in shown and (answer is None or answer.lower() in shown[gold].lower())

    def _pair_search(self, q: dict) -> tuple[str, tuple] | None:
        """For a comparison or two-chain yes/no question of one hop per chain: a query naming both
        entities and its rendered first block (block, numbers), when that shows both documents with
        their values; else None."""
        plan = q.get("plan") or []
        if (q.get("kind") not in ("compare", "yesno") or len(plan) != 2 or plan[0]["relation"] != plan[1]["relation"]
                or plan[0]["relation"] not in RELATION or not all(p.get("value") for p in plan)):
            return None  # not two one-hop chains of a wide world's relation (the records' plans say)
        noun = RELATION[plan[0]["relation"]].noun
        query = f"{noun} of {plan[0]['entity']} and {plan[1]['entity']}"
        hits = self._search(query)
        numbers = number_hits(hits, {})  # the trace's first block: nothing numbered before it
        block = self.formatter.render_block(hits, 1, numbers=numbers)
        return (query, (block, numbers)) if all(self._shows(block, p["doc"], p["value"]) for p in plan) else None

    def build(self, q: dict) -> Trace | None:
        """One question (a synthetic record) -> its trace, or None when it cannot be supported."""
        prompt = build_prompt(self.tok, q["question"], self.spec, self.system)
        ids, mask = list(prompt), [0] * len(prompt)
        trace = Trace(q["id"], q["question"], q["answer"], q["hops"], self.spec.style, ids, mask, len(prompt),
                      variant=self.variant, marker_token_ids=list(self.marker_ids), system_prompt=self.system)

        numbered: dict[str, int] = {}  # doc id -> evidence number, as the engine numbers them

        def write(text: str) -> None:
            t = self._encode(text)
            ids.extend(t)
            mask.extend([1] * len(t))

        def render(hits: list, hop: int):  # the block the engine would splice, numbered as it numbers
            numbers = number_hits(hits, numbered)
            return self.formatter.render_block(hits, hop, numbers=numbers), numbers

        def splice(rendered) -> None:
            block, numbers = rendered
            numbered.update(zip(block.doc_ids, numbers))
            ids.extend(block.token_ids)
            mask.extend([0] * len(block.token_ids))
            trace.evidence_docs.append(list(block.doc_ids))

        if not q.get("needs_retrieval", True) or q["hops"] == 0:
            trace.kind = "no_retrieval"
        elif self.one_search and (pair := self._pair_search(q)):
            query, rendered = pair
            write(self.spec.render(spoken(query)))
            trace.queries.append(query)
            splice(rendered)
            trace.kind = "one_search"
        else:
            hop = 0
            plan = hop_plan(q)
            for h, (entity, gold, phrasings) in enumerate(plan):
                if h == 0 and self.rng.random() < self.p_misleading:
                    vague = entity.split()[0]
                    hits = self._search(vague)
                    if hits and hits[0].doc_id != gold:  # the best hit is about another entity
                        hop += 1
                        write(self.spec.render(spoken(vague)))
                        trace.queries.append(vague)
                        splice(render(hits, hop))
                        trace.kind = "misleading_requery"
                elif self.rng.random() < self.p_empty:
                    hop += 1
                    first = self.rng.choice(phrasings)
                    write(self.spec.render(spoken(first)))
                    trace.queries.append(first)
                    splice(render([], hop))  # the decoder's block for a failed or empty search
                    trace.kind = "empty_requery"
                answer = q["answer"] if q.get("kind") == "chain" and h == len(plan) - 1 else None
                for query in self.rng.sample(phrasings, len(phrasings)):
                    hits = self._search(query)
                    rendered = render(hits, hop + 1) if gold in {x.doc_id for x in hits} else None
                    if rendered and self._shows(rendered[0], gold, answer):
                        break
                else:
                    self.stats.skipped += 1
                    return None
                hop += 1
                write(self.spec.render(spoken(query)))
                trace.queries.append(query)
                splice(rendered)
        write(spoken(q["answer"]))
        ids.append(self.eos)
        mask.append(1)
        self.stats.built += 1
        self.stats.kinds[trace.kind] = self.stats.kinds.get(trace.kind, 0) + 1
        return trace


def training_corpus(corpus: list) -> list:
    """The documents a training trace may show: none of a test world (``metadata.split`` starting
    with ``test``), so no held-out relation, phrasing or entity reaches training even as a
    distractor in evidence."""
    kept = [d for d in corpus if not str(d.metadata.get("split", "")).startswith("test")]
    if len(kept) < len(corpus):
        print(f"corpus: {len(corpus) - len(kept)} of {len(corpus)} documents belong to test worlds: "
              "left out of the retriever", file=sys.stderr)
    return kept
