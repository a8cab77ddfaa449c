"""Multi-turn marker traces: when a conversation needs a search, and when it does not.

Single-turn traces teach the markers; they never show a chat history, an evidence memory in the
prompt, a clarification or chit-chat, so a model trained on them alone searches on every turn.
For each synthetic conversation (``rig synth``'s ``conversations-{split}.jsonl``: a lookup, a
clarification, a detail about the entity looked up, a follow-up about the entity found, chit-chat)
this writes one trace per turn, the
way ``rig eval --conversations`` and ``Conversation.ask`` prompt the model: the chat so far (earlier
answers as the assistant turns), and, in the memory variant, the documents earlier turns retrieved
in the system message (``EvidenceMemory.prompt_text``), numbered as the engine numbers them.

What each turn teaches:

* lookup / detail / follow-up: a marker with the question as query, the decoder's evidence block
  for the real retriever's hits, the answer; a turn whose document is already in the memory (a
  detail, in the memory variant) is answered from it without a search;
* clarification: the answer again, at once (it is in the chat, and in the memory);
* chit-chat: a short reply, no marker.

In the citing variant (``cite=True``) the system message also carries ``prompt.CITE_INSTRUCTION``
(what ``rig.citations`` adds) and an answer taken from a document in context ends with that
document's number, ``Pevuth [2]``, as the engine numbers it; without the instruction answers never
cite, so the model cites only when asked.

A turn whose query does not find its gold document is dropped with the rest of its conversation.
"""

from __future__ import annotations

import random

from ..evidence import EvidenceFormatter, number_hits
from ..markers import MarkerSpec
from ..memory import EvidenceMemory
from ..prompt import build_prompt, with_cite_instruction
from ..retrieval.base import Retriever
from ..trace import RetrievedDoc
from .data import VARIANTS, BuildStats, Trace, spoken, variant_tokenizer

GREETING_REPLY = "Hello! What would you like to know?"
THANKS_REPLY = "You're welcome!"


def chit_chat_reply(text: str) -> str:
    return GREETING_REPLY if text.lower().startswith(("hello", "hi", "good morning", "hey")) else THANKS_REPLY


def query_for(question: str) -> str:
    """The query a trace writes for a question: the question itself, without chat filler."""
    q = question.strip().rstrip("?").strip()
    for filler in ("And ", "So "):
        q = q.removeprefix(filler)
    return q.replace(", then", "").strip()


class ConversationTraceBuilder:
    def __init__(self, tokenizer, retriever: Retriever, variant: str = "special", *, evidence_budget: int = 256,
                 top_k: int = 3, system_prompt: str | None = None, seed: int = 0):
        self.tok, self.retriever, self.variant = variant_tokenizer(tokenizer, variant), retriever, variant
        self.spec = MarkerSpec.from_style(VARIANTS[variant])
        self.marker_ids = (self.tok.convert_tokens_to_ids([self.spec.start[0], self.spec.end[0]])
                           if variant == "special" else [])
        self.formatter = EvidenceFormatter(tokenizer, evidence_budget)
        self.top_k, self.system, self.rng = top_k, system_prompt, random.Random(seed)
        self.stats = BuildStats()

    def build(self, conv: dict, with_memory: bool, cite: bool = False) -> list[Trace]:
        """One trace per turn of ``conv`` (none if a needed search misses its gold document)."""
        chat: list[dict] = []
        memory = EvidenceMemory()
        system = with_cite_instruction(self.system) if cite and self.system else self.system
        out = []
        for k, turn in enumerate(conv["turns"]):
            chat.append({"role": "user", "content": turn["question"]})
            prompt = build_prompt(self.tok, chat, self.spec, system, memory.prompt_text() if with_memory else "")
            answer = turn["answers"][0] if turn.get("answers") else chit_chat_reply(turn["question"])
            tag = ("-mem" if with_memory else "") + ("-cite" if cite else "")
            trace = Trace(f"{conv['id']}-t{k}{tag}", turn["question"], answer,
                          int(bool(turn.get("needs_retrieval"))), self.spec.style, list(prompt), [0] * len(prompt),
                          len(prompt), kind=f"chat_{turn.get('kind', 'turn')}", variant=self.variant,
                          marker_token_ids=list(self.marker_ids), system_prompt=system)
            # what the answer may cite: the memory block's documents, then this turn's evidence
            shown = {d.id: d.number for d in memory.in_prompt()} if with_memory else {}
            gold = set(turn.get("supporting_docs") or [])
            if turn.get("needs_retrieval") and not gold <= set(shown):
                spliced = self._search_and_splice(trace, turn["question"], gold, memory, with_memory)
                if spliced is None:
                    self.stats.skipped += 1
                    return []
                shown = {**shown, **spliced}
            cited = sorted({shown[d] for d in gold if d in shown}) if cite and turn.get("answers") else []
            written = answer + (" " + "".join(f"[{n}]" for n in cited) if cited else "")
            self._write(trace, spoken(written))
            trace.input_ids.append(self.tok.eos_token_id)
            trace.mask.append(1)
            chat.append({"role": "assistant", "content": written})  # as the engine's chat keeps it
            out.append(trace)
            self.stats.built += 1
            self.stats.kinds[trace.kind] = self.stats.kinds.get(trace.kind, 0) + 1
        return out

    def _write(self, trace: Trace, text: str) -> None:
        ids = self.tok.encode(text, add_special_tokens=False)
        trace.input_ids.extend(ids)
        trace.mask.extend([1] * len(ids))

    def _search_and_splice(self, trace: Trace, question: str, gold: set[str], memory: EvidenceMemory,
                           with_memory: bool) -> dict[str, int] | None:
        """Search, splice the evidence block; ``{doc id: number}`` of the documents it shows (None,
        nothing written, when the hits miss every gold document)."""
        query = query_for(question)
        hits = list(self.retriever.search_batch([query], self.top_k)[0])
        if not gold & {h.doc_id for h in hits}:
            return None
        self._write(trace, self.spec.render(spoken(query)))
        # as the engine numbers them: on from the memory's numbers, or from 1 in a fresh answer
        numbers = number_hits(hits, {d.id: d.number for d in memory.docs} if with_memory else {})
        block = self.formatter.render_block(hits, 1, numbers=numbers)
        trace.input_ids.extend(block.token_ids)
        trace.mask.extend([0] * len(block.token_ids))
        trace.queries.append(query)
        trace.evidence_docs.append(list(block.doc_ids))
        shown = dict(zip(block.doc_ids, numbers))
        if not with_memory:
            return shown
        known = {d.id for d in memory.docs}
        by_id = {h.doc_id: h for h in hits}
        for doc_id, n, text in zip(block.doc_ids, numbers, block.shown):
            if doc_id not in known:
                h = by_id[doc_id]
                memory.docs.append(RetrievedDoc(doc_id, h.title, h.score, h.source, n, text))
        memory.queries.append((query, numbers[: len(block.doc_ids)]))
        return shown
