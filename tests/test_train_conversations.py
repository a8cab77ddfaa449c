"""Multi-turn marker traces: a marker only where a turn needs a search, memory as the engine shows it."""

import re

from rig_decode.config import RetrieverConfig
from rig_decode.eval.synth import generate
from rig_decode.markers import MarkerMatcher, MarkerSpec, MarkerVocab
from rig_decode.retrieval.base import Document
from rig_decode.retrieval.factory import build_retriever
from rig_decode.train.conversations import THANKS_REPLY, ConversationTraceBuilder, chit_chat_reply, query_for


def _world(tmp_path):
    chats: dict = {}
    docs, _ = generate(seed=1, scale=0.34, conversations=chats)
    corpus = [Document(d["id"], d["text"], title=d.get("title")) for d in docs]
    return chats["train"], build_retriever(RetrieverConfig(type="bm25"), cache_dir=tmp_path, corpus=corpus)


def _markers(tok, trace) -> list[str]:
    """Queries of the markers in the part the model writes (mask 1)."""
    m = MarkerMatcher(MarkerVocab(tok, MarkerSpec.special_token()))
    queries = []
    for t, w in zip(trace.input_ids, trace.mask):
        if w:
            queries += [e.query for e in m.feed(t) if e.kind == "marker"]
    return queries


def test_turns_search_only_when_needed(tok_special, tmp_path):
    convs, retriever = _world(tmp_path)
    builder = ConversationTraceBuilder(tok_special, retriever, "text", evidence_budget=96)
    built = [t for c in convs[:6] for t in builder.build(c, with_memory=False)]
    assert built and builder.stats.built == len(built)
    by_kind = {}
    for t in built:
        by_kind.setdefault(t.kind, []).append(t)
    assert set(by_kind) == {"chat_lookup", "chat_clarification", "chat_detail", "chat_follow_up", "chat_chit_chat"}
    for t in by_kind["chat_lookup"] + by_kind["chat_detail"] + by_kind["chat_follow_up"]:
        assert len(_markers(tok_special, t)) == 1 and t.evidence_docs
        assert 0 in t.mask[t.prompt_len:]  # the evidence is not trained on
    for t in by_kind["chat_clarification"] + by_kind["chat_chit_chat"]:
        assert _markers(tok_special, t) == [] and t.mask[t.prompt_len:] == [1] * (len(t.input_ids) - t.prompt_len)
    # the chat history is in the prompt: turn 2 sees turn 1's answer
    first, second = by_kind["chat_lookup"][0], by_kind["chat_clarification"][0]
    assert first.answer in tok_special.decode(second.input_ids[: second.prompt_len])


def test_memory_variant_carries_earlier_documents(tok_special, tmp_path):
    convs, retriever = _world(tmp_path)
    builder = ConversationTraceBuilder(tok_special, retriever, "text", evidence_budget=96)
    traces = builder.build(convs[0], with_memory=True)
    assert len(traces) == 5
    lookup, clarify, detail, follow, chat = traces
    # the detail's document came with the lookup: with memory it is answered without a search
    assert _markers(tok_special, detail) == [] and detail.answer in tok_special.decode(detail.input_ids)
    assert "retrieved earlier" not in tok_special.decode(lookup.input_ids[: lookup.prompt_len])
    shown = tok_special.decode(clarify.input_ids[: clarify.prompt_len])
    assert "Evidence retrieved earlier in this conversation" in shown and "[1]" in shown
    # the follow-up's new documents are numbered after the memory's, as the engine numbers them
    earlier = {d: n for n, d in enumerate(lookup.evidence_docs[0], 1)}
    expected, nxt = [], len(earlier) + 1
    for d in follow.evidence_docs[0]:
        if d not in earlier:
            earlier[d], nxt = nxt, nxt + 1
        expected.append(earlier[d])
    block = tok_special.decode([t for t, w in zip(follow.input_ids, follow.mask) if not w][follow.prompt_len:])
    assert re.findall(r"^\[(\d+)\]", block, flags=re.M) == [str(n) for n in expected]
    assert max(expected) > len(lookup.evidence_docs[0])


def test_chat_filler_and_replies():
    assert query_for("And in which city is Vastrel headquartered?") == "in which city is Vastrel headquartered"
    assert query_for("Who founded Orbisk, then?") == "Who founded Orbisk"
    assert chit_chat_reply("Good morning!").startswith("Hello") and chit_chat_reply("Thanks!") == THANKS_REPLY


def test_citing_variant_cites_the_gold_document_by_its_number(tok_special, tmp_path):
    from rig_decode.prompt import CITE_INSTRUCTION

    convs, retriever = _world(tmp_path)
    builder = ConversationTraceBuilder(tok_special, retriever, "text", evidence_budget=96, system_prompt="Be brief.")
    written = lambda t: tok_special.decode([x for x, w in zip(t.input_ids, t.mask) if w])  # noqa: E731
    plain = builder.build(convs[0], with_memory=True)
    assert not any("[" in written(t).replace("<|retrieve|>", "") for t in plain)
    cited = builder.build(convs[0], with_memory=True, cite=True)
    assert all(CITE_INSTRUCTION in tok_special.decode(t.input_ids[: t.prompt_len]) for t in cited)
    lookup, clarify, detail, follow, chat = cited
    # the lookup's gold document is the first of its evidence block: number 1; the memory keeps it
    gold = convs[0]["turns"][0]["supporting_docs"][0]
    n = lookup.evidence_docs[0].index(gold) + 1
    assert written(lookup).removesuffix(tok_special.eos_token).endswith(f"{lookup.answer} [{n}]")
    assert f"{clarify.answer} [{n}]" in written(clarify) and f"{detail.answer} [{n}]" in written(detail)
    # the follow-up cites its new document by the number the engine gives it (after the memory's)
    m = re.search(rf"{re.escape(follow.answer)} \[(\d+)\]", written(follow))
    assert m and int(m.group(1)) > len(lookup.evidence_docs[0])
    assert "[" not in written(chat)
    # without memory, a clarification has no document in context: nothing to cite
    no_mem = builder.build(convs[0], with_memory=False, cite=True)
    assert "[" not in written(no_mem[1]) and f"[{n}]" in written(no_mem[0])
