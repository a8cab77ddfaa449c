"""The ONNX cross-encoder reranker (a tiny model the test builds), batched across the queries of
one call, within the latency budget, on its own and under the embedded model's hops."""

import json
import time

import pytest

from rig_decode.config import RerankerConfig, RetrieverConfig
from rig_decode.retrieval.base import Document, Hit, HitList, RetrievalError
from rig_decode.retrieval.dense import resolve_embedder
from rig_decode.retrieval.factory import build_retriever
from rig_decode.retrieval.rerank import CrossEncoderReranker, LinkReranker, RerankingRetriever

from .test_rerank_milvus import _tiny_cross_encoder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A cross-encoder folder whose logit counts 'banana' in the passage."""
    from tokenizers import Tokenizer

    folder = tmp_path_factory.mktemp("ce") / "tiny"
    tok = Tokenizer.from_file(f"{resolve_embedder('all-minilm-l6-v2')}/tokenizer.json")
    _tiny_cross_encoder(folder, tok.token_to_id("banana"), onnx_name="model.onnx")
    (folder / "reranker.json").write_text(json.dumps({"max_length": 32}))
    return folder


HITS = [Hit(f"d{i}", text, 1.0 - i / 10, title=f"T{i}") for i, text in
        enumerate(["apples are red", "a banana is yellow", "banana banana bread", "grapes"])]


class _Base:
    def __init__(self):
        self.calls = []

    def search_batch(self, queries, top_k, filters=None):
        self.calls.append((list(queries), top_k))
        return [HitList(HITS[:top_k], {"mode": "test"}) for _ in queries]


class _Counting(CrossEncoderReranker):
    def __init__(self, folder):
        super().__init__(folder)
        self.scored = []

    def score(self, pairs):
        self.scored.append(len(pairs))
        return super().score(pairs)


def test_cross_encoder_reorders_by_its_scores(tiny):
    ce = CrossEncoderReranker(tiny)
    ranked = ce.rerank("which fruit", HITS, top_n=2)
    assert [h.doc_id for h in ranked] == ["d2", "d1"]
    assert ranked[0].score > ranked[1].score and ranked[0].metadata["fusion_score"] == pytest.approx(0.8)
    assert ranked[0].title == "T2" and ranked[0].text == HITS[2].text
    # a passage past max_length is cut, not refused: the count stops at the cut
    long = Hit("x", "banana " * 200, 0.0)
    assert ce.score([("q", long.text)])[0] < 32


def test_the_queries_of_one_call_are_scored_in_one_batch(tiny):
    ce = _Counting(tiny)
    base = _Base()
    r = RerankingRetriever(base, ce, top_n=2, candidates=4, budget_ms=10_000)
    res = r.search_batch(["q1", "q2", "q3"], 3)
    assert ce.scored == [12]  # 3 queries x 4 candidates, one call
    assert base.calls == [(["q1", "q2", "q3"], 4)]
    for hits in res:
        assert [h.doc_id for h in hits] == ["d2", "d1"]
        assert hits.info["mode"] == "test" and "4 -> 2" in hits.info["rerank"] and "batch of 3" in hits.info["rerank"]


def test_queries_beyond_the_budget_keep_the_fusion_order(tiny):
    r = RerankingRetriever(_Base(), _Counting(tiny), top_n=2, candidates=4, budget_ms=10)
    r.ms_per_passage = 1.0  # 4 passages: 4 ms; 8: 8 ms; 12: over the 10 ms budget
    res = r.search_batch(["q1", "q2", "q3"], 3)
    assert [h.doc_id for h in res[0]] == ["d2", "d1"] and [h.doc_id for h in res[1]] == ["d2", "d1"]
    assert [h.doc_id for h in res[2]] == ["d0", "d1"]
    assert "over budget" in res[2].info["fallback"] and "predicted 12 ms" in res[2].info["rerank"]
    assert r.reranker.scored == [8]


def test_a_failing_cross_encoder_falls_back_for_every_query(tiny):
    class Broken(CrossEncoderReranker):
        def score(self, pairs):
            raise RuntimeError("onnx session died")

    res = RerankingRetriever(_Base(), Broken(tiny), top_n=2, candidates=4).search_batch(["a", "b"], 3)
    for hits in res:
        assert [h.doc_id for h in hits] == ["d0", "d1"] and "onnx session died" in hits.info["rerank"]


def test_a_missing_model_is_refused(tmp_path):
    with pytest.raises(RetrievalError, match="lacks model.onnx"):
        CrossEncoderReranker(tmp_path)
    cfg = RetrieverConfig(type="bm25", reranker=RerankerConfig(type="cross-encoder", model_dir=str(tmp_path)))
    with pytest.raises(RetrievalError, match="reranker model not found"):
        build_retriever(cfg, cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match="needs reranker.model_dir"):
        RerankerConfig(type="cross-encoder")


def _second_hop_keeps_the_fusion_order(session, budget: str) -> None:
    """Two questions: the first hop measures the reranker (over ``budget``, noted); the next
    question's hop keeps the fusion order, and its trace says so."""
    try:
        _, first = session.ask("Who founded the company that makes the Brisa T4?")
        assert f"over the {budget} ms budget" in first.retrieval_steps[0].info["rerank"]
        _, later = session.ask("In which city is the maker of the Lumora K7?")
        step = later.retrieval_steps[0]
        assert step.fallback == "fusion order (rerank over budget)" and step.docs
        assert step.info["rerank"].startswith("skipped: predicted")
    finally:
        session.close()


@pytest.mark.real_model
def test_a_budget_the_reranker_cannot_meet_falls_back_in_the_hops_trace(real, tiny):
    """The embedded model and the demo retriever with a cross-encoder under a 1 ms budget that
    each query's passages take longer than."""
    from rig_decode import RigConfig, RigSession

    class Slow(CrossEncoderReranker):
        def score(self, pairs):
            time.sleep(0.01)
            return super().score(pairs)

    cfg = RigConfig().updated(model={"max_tokens": 16}, rig={"retrieve_first": True},
                              retriever={"reranker": {"type": "none"}})
    r = RerankingRetriever(build_retriever(cfg.retriever), Slow(tiny), top_n=3, candidates=10, budget_ms=1.0)
    _second_hop_keeps_the_fusion_order(RigSession(cfg, retriever=r), "1")


LEAD = Hit("kiss", "Kiss and Tell is a 1945 film starring Shirley Temple as Corliss Archer.", 0.9, title="Kiss and Tell")


def _hits(*titles):
    return [LEAD] + [Hit(f"d{i}", f"text {i}", 0.8 - i / 10, title=t) for i, t in enumerate(titles)]


def test_the_link_reranker_moves_up_what_the_best_hit_names():
    hits = _hits("Meet Corliss Archer", "Shirley Temple", "Janet Waldo", "Corliss Archer (film)")
    ranked = LinkReranker().rerank("What position did the star of Kiss and Tell hold?", hits, top_n=4)
    # the best hit stays first; the titles its text names come next, each group in fusion order
    assert [h.doc_id for h in ranked] == ["kiss", "d1", "d3", "d0"]
    assert ranked[1].metadata["linked_from"] == "kiss" and "linked_from" not in ranked[3].metadata
    assert ranked[1].score == hits[2].score and ranked[1].text == hits[2].text


def test_the_link_reranker_moves_up_two_named_candidates_at_most():
    lead = Hit("index", "Meet Corliss Archer, Shirley Temple, Janet Waldo and Kiss and Tell.", 0.9, title="Index")
    hits = [lead, *_hits("Other", "Shirley Temple", "Janet Waldo", "Meet Corliss Archer")[1:]]
    # the first two named move up; the third keeps its fusion place among the rest
    assert [h.doc_id for h in LinkReranker().rerank("q", hits, top_n=5)] == ["index", "d1", "d2", "d0", "d3"]


def test_the_link_reranker_matches_whole_titles_only():
    # a title inside a longer word, a title too short to mean anything, no title: none is named
    hits = _hits("Temp", "Is", None, "Shirley Temple Black")
    assert LinkReranker().rerank("q", hits, top_n=5) == hits
    assert LinkReranker().rerank("q", hits[:2], top_n=5) == hits[:2]  # nothing to reorder


def test_the_default_reranker_ships_and_keeps_as_many_hits_as_asked(tmp_path):
    assert RerankerConfig().type == "auto"
    docs = [Document("kiss", LEAD.text, "Kiss and Tell"), Document("meet", "Meet Corliss Archer was a radio show.",
            "Meet Corliss Archer"), Document("st", "Shirley Temple, who played Archer, was later a diplomat.", "Shirley Temple")]
    r = build_retriever(RetrieverConfig(type="bm25", score_threshold=-1.0), cache_dir=tmp_path, corpus=docs)
    assert isinstance(r, RerankingRetriever) and isinstance(r.reranker, LinkReranker)
    [hits] = r.search_batch(["Kiss and Tell Corliss Archer"], 3)
    assert [h.doc_id for h in hits] == ["kiss", "st", "meet"] and hits.info["rerank"].startswith("3 -> 3")
    plain = build_retriever(RetrieverConfig(type="bm25", score_threshold=-1.0, reranker={"type": "none"}),
                            cache_dir=tmp_path, corpus=docs)
    assert not isinstance(plain, RerankingRetriever)
    assert [h.doc_id for h in plain.search_batch(["Kiss and Tell Corliss Archer"], 3)[0]] == ["kiss", "meet", "st"]


@pytest.mark.real_model
def test_the_default_reranker_under_a_budget_it_cannot_meet_falls_back_in_the_hops_trace(real):
    """The embedded model, the demo retriever and the shipped reranker with a budget no reranker
    meets."""
    from rig_decode import RigConfig, RigSession

    cfg = RigConfig().updated(model={"max_tokens": 16}, rig={"retrieve_first": True},
                              retriever={"reranker": {"budget_ms": 1e-6}})
    _second_hop_keeps_the_fusion_order(RigSession(cfg), "1e-06")
