"""The instruction that teaches a model the marker syntax, and chat-template prompt building."""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass

from .markers import MarkerSpec

_RULES = """You answer questions about Helios Gateway and other private company records. You do NOT know these facts yourself: you must look every fact up with the search tool before you state it.

How to search: write {example} and nothing else. The search results then appear between <evidence> and </evidence>.

Rules:
1. Your reply MUST start with a search. Never guess a version, name, date or number.
2. One search per fact. If the question needs two facts (for example a release and then its approver), search for the first, read the evidence, then search for the second.
3. After the evidence answers the question, give a short final answer using only the evidence.

Example:
Question: Who approved the release that fixed error E9999?
Answer: {q1}
<evidence>
[1] Helios Gateway 9.9.9 changelog: Helios Gateway release 9.9.9 fixed error E9999.
</evidence>
{q2}
<evidence>
[2] Release approval for 9.9.9: Release 9.9.9 was approved by Alex Example.
</evidence>
Release 9.9.9 fixed error E9999, and Alex Example approved it."""


MARKER_ADAPTER_PROMPT = "Answer in a few words. Search for any fact you do not know before you state it."
"""The short instruction marker traces are built with (``scripts/make_marker_data.py``): a model
trained on them needs no syntax lesson, and a short prompt makes training and every request cheaper.
A trained adapter records the prompt it was trained with, and sessions use it (``models.loader``)."""

CITE_INSTRUCTION = "Cite the evidence you use as [n]."
"""Appended to the system prompt when ``rig.citations`` is on (``RigConfig.system_prompt``); the
marker adapter's multi-turn traces carry it where their answers cite, so the model cites when asked."""


def with_cite_instruction(prompt: str) -> str:
    return prompt if CITE_INSTRUCTION in prompt else f"{prompt} {CITE_INSTRUCTION}"


def without_cite_instruction(prompt: str | None) -> str | None:
    """The prompt ``with_cite_instruction`` started from (None for none)."""
    return (prompt or "").replace(CITE_INSTRUCTION, "").strip() or None


def system_prompt(spec: MarkerSpec) -> str:
    return _RULES.format(
        example=spec.render("your search query"),
        q1=spec.render("error E9999 fixed in release"),
        q2=spec.render("release 9.9.9 approved by"),
    )


@dataclass(frozen=True)
class _Added:
    """A tokenizer's added tokens, as prompt building needs them."""

    ids: dict[str, int]
    """Each added token's text -> its id (the template's delimiters among them)."""
    control: frozenset[int]
    """Ids a request's text may never produce: special tokens (chat delimiters, end of text), added
    marker tokens, and added tags that are not special (Qwen's ``<tool_call>``, ``<think>``)."""
    splitter: re.Pattern | None
    """Splits text at added tokens, keeping them."""
    control_strings: re.Pattern | None
    prefixes: frozenset[str]
    """Proper prefixes of the control strings: a text ending in one could complete one with what
    a template writes after it."""
    suffixes: frozenset[str]
    longest: int = 0

    def unsafe(self, text: str) -> list[tuple[int, int]]:
        """Spans of ``text`` that must not meet the template: control strings, and a piece of one
        at either end."""
        spans = [m.span() for m in self.control_strings.finditer(text)] if self.control_strings else []
        n = len(text)
        head = next((j for j in range(min(self.longest, n), 0, -1) if text[:j] in self.suffixes), 0)
        tail = next((j for j in range(max(0, n - self.longest), n) if text[j:] in self.prefixes), n)
        if head and not (spans and spans[0][0] < head):
            spans.insert(0, (0, head))
        if tail < n and not (spans and spans[-1][1] > tail):
            spans.append((tail, n))
        return spans


_ADDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _added(tokenizer) -> _Added:
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else 0
    cached = _ADDED.get(tokenizer)
    if cached is None or cached[0] != size:  # tokens added since: read them again
        added = dict(getattr(tokenizer, "added_tokens_decoder", None) or {})
        markers = {s for spec in (MarkerSpec.special_token(), MarkerSpec.json()) for s in (*spec.start, *spec.end)}
        ids = {t.content: i for i, t in added.items()}
        control = frozenset(i for i, t in added.items()
                            if t.special or t.content in markers or re.fullmatch(r"<[^<>\s]{1,64}>", t.content))
        strings = [added[i].content for i in control]
        cached = (size, _Added(ids, control, _alternatives(ids, capture=True), _alternatives(strings),
                               frozenset(c[:k] for c in strings for k in range(1, len(c))),
                               frozenset(c[k:] for c in strings for k in range(1, len(c))),
                               max(map(len, strings), default=0)))
        _ADDED[tokenizer] = cached
    return cached[1]


def _alternatives(strings, capture: bool = False) -> re.Pattern | None:
    if not strings:
        return None
    body = "|".join(map(re.escape, sorted(strings, key=len, reverse=True)))
    return re.compile(f"({body})" if capture else body)


def text_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as text: a special-token string in it (``<|im_start|>``,
    ``<|retrieve|>``) is split into ordinary pieces, as OpenAI's API treats it, never one control
    id. For everything a request or a document brings; what the server writes itself is parsed."""
    added = _added(tokenizer)
    ids = _encode(tokenizer, text, split=True)
    if not added.control.intersection(ids):
        return ids
    # an added token kept whole (not special, or a tokenizer without split_special_tokens): cut
    # each control string one character in, so that no piece holds it whole
    cuts = [m.start() + 1 for m in added.control_strings.finditer(text)]
    ids = [i for a, b in zip([0, *cuts], [*cuts, len(text)]) for i in _encode(tokenizer, text[a:b], split=True)]
    if added.control.intersection(ids):
        raise ValueError("this tokenizer cannot encode the text without control tokens")
    return ids


_SLOT = "\ue000{}\ue001"
"""Stands in the rendered template for a piece of a caller's text that must not meet the template:
a control string, or a piece of one at an end (private-use characters: nothing treats them
specially). Each is put back after the template's own tokens are found, encoded as text."""


def build_prompt(tokenizer, question_or_messages, spec: MarkerSpec, system: str | None = None,
                 memory: str = "") -> list[int]:
    """Token ids of the chat prompt, ending where the assistant's reply starts; ``memory`` (an
    evidence memory's block) is appended to the system message.

    Special tokens come only from the chat template and ``system`` (the server's own prompt, whose
    example markers are real markers): every message's content, a system message among them, and
    ``memory`` are encoded as text. Texts without a control string (nor a piece of one at an end)
    go through ``apply_chat_template`` unchanged, so their ids are the tokenizer's own; the rest
    are rendered with placeholders where the control strings were (``_encode_rendered``)."""
    if isinstance(question_or_messages, str):
        if not question_or_messages.strip():
            raise ValueError("empty question")
        messages = [{"role": "user", "content": question_or_messages.strip()}]
    else:
        messages = list(question_or_messages)
        if not messages or any(not isinstance(m, dict) or "role" not in m or "content" not in m for m in messages):
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    added, texts = _added(tokenizer), []

    def guard(text) -> str | None:
        if not isinstance(text, str):
            return text
        out, at = [], 0
        for a, b in added.unsafe(text):
            texts.append(text[a:b])
            out += [text[at:a], _SLOT.format(len(texts) - 1)]
            at = b
        return "".join(out) + text[at:] if out else text

    messages = [{**m, "content": guard(m["content"])} for m in messages]
    if messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system or system_prompt(spec)}, *messages]
    if memory:
        messages = [{"role": "system", "content": f"{messages[0]['content']}\n\n{guard(memory)}"}, *messages[1:]]
    template = getattr(tokenizer, "chat_template", None)
    if not texts and template:  # no text could become a control token: the tokenizer's own ids
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    if template:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        rendered = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    return _encode_rendered(tokenizer, rendered, texts)


def _encode_rendered(tokenizer, rendered: str, texts: list[str]) -> list[int]:
    """The template's text parsed as the tokenizer parses it (its added tokens as their ids), each
    slot's text as text. Between two added tokens the text is encoded in one piece, as the tokenizer
    itself would, so a prompt without special strings in its texts gets the ids it always had."""
    added = _added(tokenizer)
    slot_re = re.compile(_SLOT.format("(\\d+)"))
    ids: list[int] = []
    for k, part in enumerate(added.splitter.split(rendered) if added.splitter else [rendered]):
        if k % 2:  # an added token the template wrote
            ids.append(added.ids[part])
        elif part:
            ids += _encode_region(tokenizer, slot_re.split(part), texts)
    return ids


def _encode_region(tokenizer, pieces: list[str], texts: list[str]) -> list[int]:
    """``pieces``: template text, slot number, template text, ... with no added token among them."""
    whole = "".join(texts[int(p)] if k % 2 else p for k, p in enumerate(pieces))
    ids = _encode(tokenizer, whole, split=True)
    if not _added(tokenizer).control.intersection(ids):
        return ids
    return [i for k, p in enumerate(pieces) for i in (text_ids(tokenizer, texts[int(p)]) if k % 2
                                                         else _encode(tokenizer, p, split=True))]


def _encode(tokenizer, text: str, split: bool) -> list[int]:
    if not text:
        return []
    try:
        return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=split))
    except TypeError:  # a tokenizer without the option: text_ids's control check does the splitting
        return list(tokenizer.encode(text, add_special_tokens=False))
