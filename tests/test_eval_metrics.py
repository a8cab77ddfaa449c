import pytest

from rig_decode.eval import metrics as M
from rig_decode.eval.runner import aggregate


def test_normalisation_and_exact_match():
    assert M.normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert M.exact_match("the Paris.", ["Paris"]) == 1.0
    assert M.exact_match("Paris, France", ["Paris"]) == 0.0


def test_f1_hand_computed():
    # pred tokens: [release, 421, fixed, it]; gold: [release, 421]; overlap 2 -> P=2/4, R=2/2, F1=2/3
    assert M.f1_score("Release 4.2.1 fixed it", ["release 4.2.1"]) == pytest.approx(2 / 3)
    assert M.f1_score("nothing", ["release"]) == 0.0
    assert M.f1_score("a", ["the"]) == 1.0  # both normalise to empty
    assert M.f1_score("x y", ["z", "x y"]) == 1.0  # best over golds


def test_contains_answer_uses_word_boundaries():
    assert M.contains_answer("It was made by Velora Dynamics.", ["Velora Dynamics"]) == 1.0
    assert M.contains_answer("Answer: 38", ["38"]) == 1.0
    assert M.contains_answer("Answer: 380", ["38"]) == 0.0


def test_source_claims():
    assert M.claims_sources("According to the documents, it is Berlin.")
    assert M.claims_sources("The evidence shows that Priya approved it.")
    assert not M.claims_sources("Priya Raman approved it.")


def test_hop_relevance_with_and_without_gold_ids():
    assert M.hop_is_relevant(["a", "b"], ["", ""], ["b"], ["x"])
    assert not M.hop_is_relevant(["a"], [""], ["b"], ["x"])
    assert M.hop_is_relevant(["a"], ["Berlin is a city"], [], ["Berlin"])


def _rec(**kw):
    base = dict(em=0.0, f1=0.0, accuracy=0.0, hops=0, relevant_hops=0, judged_hops=0, support_recall=None,
                needs_retrieval=True, markers_valid=0, markers_invalid=0, token_overhead=0.0, total_tokens=10,
                latency_ms=100.0, source_claim_without_hop=False, gold_hops=1, evidence_kept=0, splice_ms=0.0)
    base.update(kw)
    return base


def test_aggregate_hand_computed():
    recs = [
        _rec(accuracy=1.0, em=1.0, hops=2, relevant_hops=1, judged_hops=2, support_recall=0.5,
             markers_valid=2, latency_ms=100, gold_hops=2, evidence_kept=100, splice_ms=30.0),
        _rec(hops=1, relevant_hops=1, judged_hops=1, support_recall=1.0, markers_valid=1, markers_invalid=1,
             latency_ms=300, gold_hops=1, evidence_kept=60, splice_ms=10.0),
        _rec(needs_retrieval=False, hops=1, judged_hops=0, latency_ms=200, gold_hops=0,
             source_claim_without_hop=False),
        _rec(needs_retrieval=False, hops=0, latency_ms=400, gold_hops=0, source_claim_without_hop=True),
    ]
    m = aggregate(recs, wall_s=2.0)
    assert m["accuracy"] == 0.25 and m["exact_match"] == 0.25
    assert m["retrieval_precision"] == pytest.approx(2 / 3)  # 2 relevant of 3 judged hops
    assert m["support_recall"] == pytest.approx(0.75)
    assert m["hops_per_question"] == 1.0
    assert m["unnecessary_retrieval_rate"] == 0.5
    assert m["marker_validity"] == 0.75
    assert m["latency_p50_ms"] == 250.0
    assert m["source_claims_without_hop"] == 0.25
    assert m["accuracy_by_hops"] == {"0": 0.0, "1": 0.0, "2": 1.0}
    assert m["evidence_kept_per_question"] == 40.0  # (100 + 60 + 0 + 0) / 4
    assert m["splice_ms_per_hop"] == 10.0  # 40 ms over 4 hops


def test_plan_orders_runs_and_limits_the_reference():
    from rig_decode.eval.runner import plan

    keys = plan(["none", "rag", "rig", "rig-reprefill"], [1, 2, 3], [2])
    assert [k.label for k in keys] == ["none", "rag", "rig@1", "rig@2", "rig@3", "rig-reprefill@2"]
    with pytest.raises(ValueError, match="unknown method"):
        plan(["rig", "self-rag"], [1])
    with pytest.raises(ValueError, match="subset"):
        plan(["rig-reprefill"], [1], [4])
