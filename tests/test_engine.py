"""Engine behaviour around hops: batching of queries, errors, limits and what the answer shows."""

import pytest

from rig_decode.engine import EngineOptions, RigEngine
from rig_decode.evidence import NO_EVIDENCE
from rig_decode.markers import MarkerSpec, MarkerVocab

from .helpers import ForceScript, ScriptedRetriever


def make(model, tok, script, retriever=None, **opts):
    base = dict(max_iterations=3, max_new_tokens=40, evidence_token_budget=60, top_k=2)
    base.update(opts)
    engine = RigEngine(model, tok, retriever or ScriptedRetriever(), EngineOptions(**base),
                       extra_processors=[ForceScript(script)])
    return engine


def marker(tok, q):
    return MarkerVocab(tok, MarkerSpec.special_token()).marker_token_ids(q)


def test_queries_pending_at_one_step_go_in_one_batch(model, tok):
    r = ScriptedRetriever()
    m1, m2, m3 = marker(tok, "aa"), marker(tok, "bb"), marker(tok, "cc")
    # rows 0 and 1 finish their markers at the same step, row 2 later
    script = {0: {0: m1}, 1: {len(m1) - len(m2): m2} if len(m1) >= len(m2) else {0: m2}, 2: {20: m3}}
    e = make(model, tok, script, r)
    e.generate([e.new_sequence(tok.encode(p), i) for i, p in enumerate(["x", "yy", "zzz"])])
    assert sorted(map(sorted, r.batches)) == [["aa", "bb"], ["cc"]]


def test_failed_retriever_records_error_and_continues_with_no_evidence(model, tok):
    e = make(model, tok, {0: {0: marker(tok, "E1234")}}, ScriptedRetriever(fail=True))
    s = e.generate([e.new_sequence(tok.encode("q"), 0)])[0]
    step = s.trace.retrieval_steps[0]
    assert "ConnectionError" in step.error and step.fallback == "no-evidence block"
    assert NO_EVIDENCE in tok.decode(s.token_ids[step.position : step.position + step.evidence_tokens])
    assert s.finish_reason == "length" and s.num_generated == 40  # generation went on


def test_retriever_timeout(model, tok):
    e = make(model, tok, {0: {0: marker(tok, "slow")}}, ScriptedRetriever(delay_s=2.0), retrieval_timeout_s=0.2)
    s = e.generate([e.new_sequence(tok.encode("q"), 0)])[0]
    assert "timed out" in s.trace.retrieval_steps[0].error
    assert s.trace.retrieval_steps[0].latency_ms < 1500


def test_empty_query_gets_no_search(model, tok):
    r = ScriptedRetriever()
    e = make(model, tok, {0: {0: tok.encode("<|retrieve|> <|endofretrieve|>")}}, r)
    s = e.generate([e.new_sequence(tok.encode("q"), 0)])[0]
    assert r.batches == [] and s.trace.retrieval_steps[0].error == "empty query"


def test_marker_on_the_last_allowed_token_does_not_retrieve(model, tok):
    m = marker(tok, "late")
    r = ScriptedRetriever()
    e = make(model, tok, {0: {10 - len(m): m}}, r, max_new_tokens=10)
    s = e.generate([e.new_sequence(tok.encode("q"), 0)])[0]
    assert r.batches == [] and s.finish_reason == "length"
    assert "token limit" in s.trace.retrieval_steps[0].error


def test_stop_token_ends_a_row(model, tok):
    e = make(model, tok, {0: {3: [tok.eos_token_id]}})
    s = e.generate([e.new_sequence(tok.encode("q"), 0)])[0]
    assert s.finish_reason == "stop" and s.num_generated == 4


def test_prompt_longer_than_context_is_rejected(tok):
    from .helpers import tiny_model

    small = tiny_model(len(tok), max_positions=32)
    e = make(small, tok, {})
    with pytest.raises(ValueError, match=r"prompt is 40 tokens; the model's context holds 32"):
        e.new_sequence([5] * 40)
    with pytest.raises(ValueError, match="empty prompt"):
        e.new_sequence([])


def test_context_fills_up_mid_answer(tok):
    from .helpers import tiny_model

    small = tiny_model(len(tok), max_positions=64)
    e = make(small, tok, {0: {0: marker(tok, "x")}}, max_new_tokens=200, evidence_token_budget=200)
    s = e.generate([e.new_sequence(tok.encode("question"), 0)])[0]
    assert s.finish_reason == "context_full" and len(s.token_ids) <= 64


def test_deadline(model, tok):
    e = make(model, tok, {0: {0: marker(tok, "slow")}}, ScriptedRetriever(delay_s=0.3), deadline_s=0.2,
             max_new_tokens=500)
    s = e.generate([e.new_sequence(tok.encode("q"), 0)])[0]
    assert s.finish_reason == "deadline" and s.num_generated < 500


def test_masks_and_trace_token_counts(model, tok):
    m = marker(tok, "E1234")
    e = make(model, tok, {0: {2: m}})
    s = e.generate([e.new_sequence(tok.encode("q"), 0)])[0]
    step = s.trace.retrieval_steps[0]
    assert len(s.token_ids) == len(s.mask) == s.num_prompt_tokens + s.num_generated + s.trace.evidence_tokens
    # The script forced the marker (one finite logit): those tokens are mask 0, the rest sampled.
    start = s.num_prompt_tokens + 2
    assert s.mask[start : start + len(m)] == [0] * len(m)
    assert sum(s.mask) == s.num_generated - len(m)
    assert s.trace.marker_tokens == len(m)
    assert step.docs and step.docs[0].id and step.latency_ms >= 0 and step.splice_ms > 0
    assert s.trace.ttft_ms > 0 and s.trace.decode_ms > 0


def test_sampling_is_seeded_and_batch_independent(model, tok):
    def run(prompts, seq_ids):
        e = make(model, tok, {}, temperature=1.0, top_p=0.9, seed=7, max_new_tokens=15)
        return [s.token_ids for s in e.generate([e.new_sequence(tok.encode(p), i) for i, p in zip(seq_ids, prompts)])]

    batch = run(["hello", "the answer"], [0, 1])
    assert batch == run(["hello", "the answer"], [0, 1])
    assert run(["the answer"], [1])[0] == batch[1]
    assert batch[0] != run(["hello"], [5])[0]  # a different seed stream gives different text


def test_retriever_decisions_reach_the_trace(model, tok):
    from rig_decode.retrieval.base import Hit, HitList

    class Deciding:
        def search_batch(self, queries, top_k, filters=None):
            return [HitList([Hit("d1", "text", 0.5)], {"mode": "hybrid", "router": "exact terms",
                                                        "fallback": "dense search failed -> lexical only"})
                    for _ in queries]

    e = make(model, tok, {0: {0: marker(tok, "E1234")}}, Deciding())
    step = e.generate([e.new_sequence(tok.encode("q"), 0)])[0].trace.retrieval_steps[0]
    assert step.info["router"] == "exact terms" and step.fallback.startswith("dense search failed")
    assert step.error is None and [d.id for d in step.docs] == ["d1"]


def test_a_stop_string_finishes_the_request_in_the_engine(model, tok):
    """Stop strings are the engine's: the row ends at once with reason ``stop`` (no cancel, no one
    rewriting its trace), its answer cut before the string, and no token decoded after it."""
    said = tok.encode(" Release fixed it. Then more text follows", add_special_tokens=False)
    e = make(model, tok, {0: {0: said}}, max_new_tokens=len(said) + 10)
    free = e.generate([e.new_sequence(tok.encode("q"), 0)])[0]
    assert "fixed it. Then" in free.answer_text
    e = make(model, tok, {0: {0: said}}, max_new_tokens=len(said) + 10)
    s = e.generate([e.new_sequence(tok.encode("q"), 0, stop=["it."])])[0]
    assert s.finish_reason == "stop" and s.trace.finish_reason == "stop"
    assert s.answer_text == "Release fixed "
    assert s.num_generated < len(said)  # stopped where the string completed, not at the token limit


def test_the_engine_finishes_a_turn_once_citations_and_memory_included(model, tok):
    """The citation check and the conversation memory happen when the sequence finishes, for every
    caller; a failed turn is not remembered."""
    from rig_decode.memory import EvidenceMemory

    m = marker(tok, "E1234")
    memory = EvidenceMemory()
    said = tok.encode(" Fixed in 4.2.1 [1].", add_special_tokens=False) + [tok.eos_token_id]
    e = make(model, tok, {0: {0: m, len(m): said}}, max_new_tokens=len(m) + len(said) + 5)
    s = e.generate([e.new_sequence(tok.encode("q"), 0, memory=memory)])[0]
    assert s.finish_reason == "stop" and s.answer_text == "Fixed in 4.2.1 [1]."
    assert [c["number"] for c in s.trace.citations] == [1] and s.trace.citations[0]["valid"]
    shown = [d.id for d in s.trace.retrieval_steps[0].docs]
    assert [q for q, _ in memory.queries] == ["E1234"] and [d.id for d in memory.docs] == shown and shown

    class Fails:
        def apply(self, rows, scores):
            raise RuntimeError("broken processor")

    failed = EvidenceMemory()
    e = make(model, tok, {0: {0: m}})
    e.processors.insert(0, Fails())
    s = e.generate([e.new_sequence(tok.encode("q"), 0, memory=failed)])[0]
    assert s.finish_reason == "error" and "broken processor" in s.trace.engine_errors[0]
    assert not failed.queries and not failed.docs
