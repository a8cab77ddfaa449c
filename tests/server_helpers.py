"""A served tiny engine for the server tests: scripted answers, a real HTTP socket."""

from __future__ import annotations

import time

from rig_decode.config import RigConfig
from rig_decode.engine import EngineOptions, RigEngine
from rig_decode.server.background import serve_in_thread

from .helpers import ScriptedRetriever

ANSWER = "Grüße aus Köln, 東京 and 🚀 emoji."
QUERY = "error E1234 fixed in release"


class ScriptAll:
    """Every row writes one marker first (if its hop budget allows one), then ``ANSWER``, then
    stops; ``endless`` rows never stop. The tiny model's own choices never show."""

    def __init__(self, vocab, tok, eos: int, endless: bool = False):
        self.marker = vocab.marker_token_ids(QUERY)
        self.answer = tok.encode(ANSWER, add_special_tokens=False) + ([] if endless else [eos])
        self.filler = tok.encode(" and", add_special_tokens=False)[0]

    def apply(self, rows, scores):
        for i, seq in enumerate(rows):
            hops = seq.max_iterations if seq.max_iterations is not None else 1
            script = (self.marker if hops > 0 else []) + self.answer
            k = seq.num_generated
            want = script[k] if k < len(script) else self.filler
            scores[i].fill_(float("-inf"))
            scores[i, want] = 0.0
        return scores


def tiny_engine(model, tok, *, endless=False, retriever=None, **opts) -> RigEngine:
    options = EngineOptions(**{"max_iterations": 2, "max_new_tokens": 120, "evidence_token_budget": 64,
                               "top_k": 2, "newline_ends_query": False, "reuse_similarity": 0.8,
                               **opts})
    engine = RigEngine(model, tok, retriever or ScriptedRetriever(), options)
    engine.processors.insert(0, ScriptAll(engine.vocab, tok, engine.stop_ids[0], endless))
    return engine


def tiny_config(**server) -> RigConfig:
    return RigConfig.from_dict({"model": {"name": "tiny", "max_tokens": 120}, "server": server})


serve = serve_in_thread


def ask_plain_and_streamed(base: str, model: str, question: str):
    """One chat question through the official ``openai`` client, plainly and streamed: (the plain
    completion, the streamed text, the hop queries the stream's ``rig`` events carried)."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": question}]
    plain = client.chat.completions.create(model=model, messages=messages)
    text, hops = [], []
    for chunk in client.chat.completions.create(model=model, messages=messages, stream=True):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
        elif "hop" in (chunk.model_extra.get("rig") or {}):
            hops.append(chunk.model_extra["rig"]["hop"]["query"])
    return plain, "".join(text), hops


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()

