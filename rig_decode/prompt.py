"""The instruction that teaches a model the marker syntax, and chat-template prompt building."""

from __future__ import annotations

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


def build_prompt(tokenizer, question_or_messages, spec: MarkerSpec, system: str | None = None,
                 memory: str = "") -> list[int]:
    """Token ids of the chat prompt, ending where the assistant's reply starts; ``memory`` (an
    evidence memory's block) is appended to the system message."""
    if isinstance(question_or_messages, str):
        if not question_or_messages.strip():
            raise ValueError("empty question")
        messages = [{"role": "user", "content": question_or_messages.strip()}]
    else:
        messages = list(question_or_messages)
        if not messages or any(not isinstance(m, dict) or "role" not in m or "content" not in m for m in messages):
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    if messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system or system_prompt(spec)}, *messages]
    if memory:
        messages = [{"role": "system", "content": f"{messages[0]['content']}\n\n{memory}"}, *messages[1:]]
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return list(ids)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    return tokenizer.encode(text, add_special_tokens=False)
