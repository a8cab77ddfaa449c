"""Evidence blocks: the tokens spliced into a sequence after a retrieve marker.

A block is tokenised on its own (never merged with the text around it, so earlier token ids stay
as they are) and fits a token budget: documents are added best first, the one that crosses the
budget is cut at a token boundary and marked with an ellipsis, the rest are dropped. Documents are
numbered so answers can cite them, across a sequence's hops and a conversation's turns
(``number_hits``): a document keeps its number, a new one gets the next, so ``[n]`` names one
document throughout. The same hits always give the same token ids. A document's number and its
text are tokenised apart, so its text has the same tokens under any number (``segments`` marks the
pieces, ``leads`` what zero-prefill computes each after: ``[1]`` for a text, so that its KV is
reused under any number); a tokenizer that would tokenise a probe line differently so keeps each
line whole (byte-level BPE tokenizers, the targets here, give the whole line's tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .prompt import text_ids
from .retrieval.base import Hit

NO_EVIDENCE = "No evidence available."
_MIN_DOC_TOKENS = 8


@dataclass(slots=True)
class EvidenceBlock:
    token_ids: list[int]
    text: str
    doc_ids: list[str]
    truncated: bool
    shown: list[str] = field(default_factory=list)
    """Per rendered document, the text the block shows of it (cut where the budget cut it)."""
    segments: list[int] = field(default_factory=list)
    """Lengths of the separately tokenised pieces ``token_ids`` is made of (head, per document its
    number ``[n]`` and its text, tail): each piece's KV can be computed alone and reused
    (``kernels/chunk_kv.py``), a document's text whatever number it has."""
    leads: list[list[int]] = field(default_factory=list)
    """Per piece, the tokens its KV is computed after, not kept (empty: alone; no list: none has
    one): a document's text is computed after ``[1]``, as it would be under number 1."""


def number_hits(hits: list[Hit], known: dict[str, int]) -> list[int]:
    """Each hit's evidence number: a document already numbered (``known``: doc id -> number) keeps
    its number, a new one gets the next after the highest."""
    nxt = max(known.values(), default=0) + 1
    out, fresh = [], {}
    for h in hits:
        n = known.get(h.doc_id) or fresh.get(h.doc_id)
        if n is None:
            n = fresh[h.doc_id] = nxt
            nxt += 1
        out.append(n)
    return out


class EvidenceFormatter:
    def __init__(self, tokenizer, budget: int = 384):
        self.tokenizer, self.budget = tokenizer, budget
        self._head = self._encode("\n<evidence>\n")
        self._tail = self._encode("</evidence>\n")
        self._ellipsis = self._encode(" …\n")
        self._empty = self._encode(NO_EVIDENCE + "\n")
        # A document's number is a piece of its own, so the text's piece is the same under any
        # number; unless this tokenizer would tokenise the line differently whole.
        one, probe = self._encode("[1]"), "[1] Title: some text.\n"
        self._number_apart = one + self._encode(probe[3:]) == self._encode(probe)
        self._text_lead = one if self._number_apart else []
        if budget < self.min_budget:
            raise ValueError(f"evidence_token_budget {budget} cannot hold even an empty evidence block "
                             f"({self.min_budget} tokens)")

    @property
    def min_budget(self) -> int:
        return len(self._head) + len(self._tail) + len(self._empty)

    def _encode(self, text: str) -> list[int]:
        return text_ids(self.tokenizer, text)  # a document's "<|endofretrieve|>" stays text

    def render(self, hits: list[Hit], hop: int, budget: int | None = None,
               numbers: list[int] | None = None) -> list[int]:
        return self.render_block(hits, hop, budget, numbers).token_ids

    def render_reference(self, numbers: list[int], budget: int | None = None) -> EvidenceBlock:
        """The block for a hop answered from documents already in context: their numbers only."""
        refs = ", ".join(f"[{n}]" for n in numbers)
        body = self._encode(f"Already retrieved: see {refs} above.\n")
        budget = self.budget if budget is None else min(budget, self.budget)
        if len(self._head) + len(body) + len(self._tail) > budget:
            raise ValueError(f"{budget} tokens cannot hold a reference block")
        return EvidenceBlock(self._head + body + self._tail, f"\n<evidence>\nAlready retrieved: see {refs} above.\n"
                             "</evidence>\n", [], False, segments=[len(self._head), len(body), len(self._tail)])

    def render_block(self, hits: list[Hit], hop: int, budget: int | None = None,
                     numbers: list[int] | None = None) -> EvidenceBlock:
        """``hop`` is 1-based; ``budget`` (tokens, default the formatter's) may only shrink it;
        ``numbers``: each hit's number (``number_hits``; default 1, 2, ...)."""
        budget = self.budget if budget is None else min(budget, self.budget)
        if budget < self.min_budget:
            raise ValueError(f"{budget} tokens cannot hold an evidence block")
        room = budget - len(self._head) - len(self._tail)
        body: list[int] = []
        pieces: list[tuple[int, list[int]]] = []  # (length, lead)
        lines: list[str] = []
        doc_ids: list[str] = []
        shown: list[str] = []
        truncated = False
        numbers = numbers or list(range(1, len(hits) + 1))
        for n, hit in zip(numbers, hits):
            title = f"{hit.title}: " if hit.title else ""
            text = " ".join(hit.text.split())
            line = f"[{n}] {title}{text}\n"
            if self._number_apart:
                number, rest = self._encode(f"[{n}]"), self._encode(line[len(f"[{n}]"):])
                ids, parts = number + rest, [(len(number), []), (len(rest), self._text_lead)]
            else:
                ids = self._encode(line)
                parts = [(len(ids), [])]
            if len(ids) > room:
                keep = room - len(self._ellipsis)
                if keep >= _MIN_DOC_TOKENS:
                    ids = ids[:keep] + self._ellipsis
                    line = self.tokenizer.decode(ids[:keep]) + " …\n"
                    body += ids
                    for length, lead in parts:  # the pieces of the tokens kept, then the ellipsis
                        if keep > 0:
                            pieces.append((min(length, keep), lead))
                        keep -= length
                    pieces.append((len(self._ellipsis), []))
                    lines.append(line)
                    doc_ids.append(hit.doc_id)
                    shown.append(line[len(f"[{n}] {title}"):].rstrip("\n"))
                truncated = True
                break
            body += ids
            pieces += parts
            room -= len(ids)
            lines.append(line)
            doc_ids.append(hit.doc_id)
            shown.append(text)
        if not body:
            body, pieces, lines = list(self._empty), [(len(self._empty), [])], [NO_EVIDENCE + "\n"]
        text = "\n<evidence>\n" + "".join(lines) + "</evidence>\n"
        pieces = [(len(self._head), []), *pieces, (len(self._tail), [])]
        return EvidenceBlock(self._head + body + self._tail, text, doc_ids, truncated, shown,
                             [n for n, _ in pieces], [lead for _, lead in pieces])
