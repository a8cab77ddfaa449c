"""Evidence memory: near-duplicate hops reference earlier documents; conversations carry evidence."""

from rig_decode.config import RigConfig
from rig_decode.engine import EngineOptions, RigEngine
from rig_decode.memory import EvidenceMemory, find_reuse, query_similarity
from rig_decode.session import RigSession
from rig_decode.trace import RetrievalStep, RetrievedDoc, Trace

from .helpers import ScriptedRetriever


class Queries:
    """Writes one marker per query (the next right after the previous evidence), then stops."""

    def __init__(self, vocab, eos, queries):
        self.plan = [t for q in queries for t in vocab.marker_token_ids(q)] + [eos]

    def apply(self, rows, scores):
        for i, seq in enumerate(rows):
            k = min(seq.num_generated, len(self.plan) - 1)
            scores[i].fill_(float("-inf"))
            scores[i, self.plan[k]] = 0.0
        return scores


def test_query_similarity():
    assert query_similarity("error E1234 fixed in release", "release that fixed error E1234") == 1.0
    assert query_similarity("Priya Raman office", "release 4.2.1 approver") == 0.0
    assert 0.3 < query_similarity("Priya Raman office", "Priya Raman manager") < 0.7


def test_memory_numbers_documents_once():
    t = Trace(retrieval_steps=[
        RetrievalStep(1, "q1", docs=[RetrievedDoc("a", "A", 1.0, "dense", 1, "alpha"),
                                     RetrievedDoc("b", "B", 0.9, "dense", 2, "beta")]),
        RetrievalStep(2, "q2", docs=[RetrievedDoc("b", "B", 0.9, "dense", 3, "beta"),
                                     RetrievedDoc("c", None, 0.5, "bm25", 4, "gamma")])])
    m = EvidenceMemory()
    m.remember(t)
    assert [(d.id, d.number) for d in m.docs] == [("a", 1), ("b", 2), ("c", 4)]  # numbers as shown
    assert m.queries == [("q1", [1, 2]), ("q2", [3, 4])]
    assert "[1] A: alpha" in m.prompt_text() and "[4] gamma" in m.prompt_text()
    assert find_reuse("q1", m, Trace(), 0.8).numbers == [1, 2]
    assert find_reuse("something else", m, Trace(), 0.8) is None
    small = EvidenceMemory(max_prompt_docs=2)
    small.remember(t)
    assert [d.id for d in small.in_prompt()] == ["b", "c"] and "[1]" not in small.prompt_text()
    assert find_reuse("q1", small, Trace(), 0.8) is None  # its documents left the prompt
    # Summary mode: this answer's blocks leave the cache, so only documents in the prompt count.
    assert find_reuse("q2", None, t, 0.8).numbers == [3, 4]
    assert find_reuse("q2", None, t, 0.8, hops_in_context=False) is None
    assert find_reuse("q2", small, t, 0.8, hops_in_context=False) is None  # [3] is not in the prompt
    reused = Trace(retrieval_steps=[RetrievalStep(1, "q9", info={"reuse": {"numbers": [2, 4]}})])
    assert find_reuse("q9", small, reused, 0.8, hops_in_context=False).numbers == [2, 4]


def test_a_repeated_query_in_one_answer_is_not_searched_again(model, tok):
    retriever = ScriptedRetriever()
    opts = EngineOptions(max_iterations=3, max_new_tokens=80, evidence_token_budget=200, reuse_similarity=0.8,
                         newline_ends_query=False)
    engine = RigEngine(model, tok, retriever, opts)
    engine.processors.insert(0, Queries(engine.vocab, engine.stop_ids[0],
                                        ["error E1234 fixed in release", "release fixed error E1234"]))
    seq = engine.new_sequence(tok.encode("Which release fixed E1234?"), seq_id=0)
    engine.generate([seq])
    first, second = seq.trace.retrieval_steps
    assert len(retriever.batches) == 1 and first.docs and not second.docs
    assert second.info["reuse"]["numbers"] == [d.number for d in first.docs]
    assert second.info["reuse"]["similarity"] == 1.0 and second.fallback is None
    assert "Already retrieved: see [1], [2], [3] above." in tok.decode(seq.token_ids)
    off = RigEngine(model, tok, ScriptedRetriever(), EngineOptions(max_iterations=3, max_new_tokens=80,
                                                                     newline_ends_query=False))
    off.processors.insert(0, Queries(off.vocab, off.stop_ids[0],
                                     ["error E1234 fixed in release", "release fixed error E1234"]))
    s2 = off.new_sequence(tok.encode("Which release fixed E1234?"), seq_id=0)
    off.generate([s2])
    assert len(off.retriever.batches) == 2  # reuse off: searched twice


def test_a_conversation_carries_its_evidence(model, tok):
    retriever = ScriptedRetriever()
    cfg = RigConfig.from_dict({"rig": {"max_iterations": 2, "newline_ends_query": False, "citations": True},
                               "model": {"max_tokens": 60}, "retriever": {"top_k": 2}})
    session = RigSession(cfg, model=model, tokenizer=tok, retriever=retriever)
    script = {"q": ["Priya Raman approved release"]}

    class Turn:
        def apply(self, rows, scores):
            return Queries(session.engine.vocab, session.engine.stop_ids[0], script["q"]).apply(rows, scores)

    session.engine.processors.insert(0, Turn())
    conv = session.conversation()
    _, t1 = conv.ask("Who approved release 4.2.1?")
    assert t1.num_hops == 1 and len(retriever.batches) == 1 and [d.number for d in t1.retrieval_steps[0].docs] == [1, 2]
    script["q"] = ["release approved by Priya Raman", "error E1234 fixed in"]
    _, t2 = conv.ask("And when did Priya Raman approve it?")
    assert [d.id for d in t2.memory_docs] == [d.id for d in t1.retrieval_steps[0].docs]
    reused, searched = t2.retrieval_steps
    assert reused.info["reuse"]["numbers"] == [1, 2] and len(retriever.batches) == 2  # one new search only
    assert [d.number for d in searched.docs] == [3, 4]  # numbering continues after the memory
    assert len(conv.memory.docs) >= 3 and conv.memory.queries[0][0] == "Priya Raman approved release"
    prompt = tok.decode(session.prompt_ids(conv.messages, conv.memory))
    assert "Evidence retrieved earlier in this conversation" in prompt and "[1]" in prompt
