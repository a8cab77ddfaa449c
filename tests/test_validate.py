"""What a retriever returns is checked at the boundary: good hits pass as fresh copies, bad hits
are dropped and counted, a bad list fails its query, a bad call fails every query."""

import json
import math

import pytest

from rig_decode.retrieval.base import Hit, HitList
from rig_decode.retrieval.validate import MAX_TEXT_CHARS, BadResults, check_results


def good(i="d1", score=0.9):
    return Hit(i, f"text of {i}", score, title=f"title {i}", metadata={"k": 1}, source="bm25")


def test_good_hits_pass_as_copies_with_their_info():
    original = HitList([good("d1"), {"doc_id": "d2", "text": "from a mapping", "score": 1}], {"mode": "hybrid"})
    [checked] = check_results([original], 1)
    assert [h.doc_id for h in checked] == ["d1", "d2"] and checked.info == {"mode": "hybrid"}
    assert checked[0] == original[0] and checked[0] is not original[0]
    assert isinstance(checked[1], Hit) and checked[1].score == 1.0 and checked[1].source == "dense"
    original[0].text = "changed later"
    assert checked[0].text == "text of d1"  # a retriever mutating its objects changes no trace


@pytest.mark.parametrize("bad, why", [
    ("a string", "a hit is a Hit or a mapping"),
    (None, "a hit is a Hit or a mapping"),
    (Hit("d9", None, 0.5), "text of 'd9' must be a str"),
    (Hit("", "text", 0.5), "doc_id must be a non-empty str"),
    (Hit(7, "text", 0.5), "doc_id must be a non-empty str"),
    (Hit("d9", "text", math.nan), "finite number"),
    (Hit("d9", "text", -math.inf), "finite number"),
    (Hit("d9", "text", "0.5"), "finite number"),
    (Hit("d9", "text", True), "finite number"),
    (Hit("d9", "text", 0.5, title=3), "title of 'd9'"),
    (Hit("d9", "text", 0.5, metadata=[1]), "metadata of 'd9'"),
    (Hit("d9", "text", 0.5, source=None), "source of 'd9'"),
    ({"doc_id": "d9"}, "text of 'd9' must be a str"),
])
def test_a_bad_hit_is_dropped_and_counted(bad, why):
    [checked] = check_results([[good("d1"), bad, good("d2")]], 1)
    assert [h.doc_id for h in checked] == ["d1", "d2"]
    assert checked.info["dropped_hits"] == 1 and why in checked.info["dropped_reason"]


def test_a_bad_list_fails_its_query_alone():
    out = check_results([[good()], None, "hits", {"doc_id": "x"}, (good("d3"),)], 5)
    assert [h.doc_id for h in out[0]] == ["d1"] and [h.doc_id for h in out[4]] == ["d3"]
    assert all(isinstance(o, str) for o in out[1:4])
    assert "NoneType" in out[1] and "str" in out[2] and "dict" in out[3]


@pytest.mark.parametrize("results", [None, "hits", {"q": []}, 3, [[good()]], [[], [], []]])
def test_a_call_that_does_not_answer_each_query_fails_whole(results):
    with pytest.raises(BadResults):
        check_results(results, 2)


def test_huge_texts_are_clipped_and_info_is_kept_json_safe():
    huge = Hit("big", "word " * 100_000, 1.0, title="t" * 5000)
    info = {"weights": (0.5, 0.5), "nan": math.nan, "obj": object()}
    [checked] = check_results([HitList([huge], info)], 1)
    assert len(checked[0].text) == MAX_TEXT_CHARS and len(checked[0].title) == 1024
    assert checked.info["clipped_texts"] == 1
    json.dumps(checked.info, allow_nan=False)  # what the server sends
    assert checked.info["weights"] == [0.5, 0.5] and checked.info["nan"] == "NaN"
    [odd] = check_results([HitList([good()], {("tuple", "key"): 1})], 1)
    assert "info_dropped" in odd.info and [h.doc_id for h in odd] == ["d1"]
