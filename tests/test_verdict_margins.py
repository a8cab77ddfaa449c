"""scripts/verdict_margins.py: the two answers a verdict chooses between, and the AUC of a margin."""

from .helpers import load_script

script = load_script("scripts/verdict_margins.py")


def test_the_two_answers_of_a_verdict():
    assert script.candidates({"kind": "yesno", "entities": ["X"], "answer": "no"}) == ("yes", "no")
    # a comparison over two chains: [a0, a, b0, b], the compared entities end each half
    two_hop = {"kind": "compare", "entities": ["Brisa T4", "Tetrula Labs", "Lumora K7", "Drainis Works"]}
    assert script.candidates(two_hop) == ("Tetrula Labs", "Drainis Works")
    assert script.candidates({"kind": "compare", "entities": ["Tasho", "Dauskios"]}) == ("Tasho", "Dauskios")


def test_auc_is_half_when_the_margin_ignores_the_truth():
    assert script.auc([3.0, 2.0, -1.0, -2.0], [True, True, False, False]) == 1.0
    assert script.auc([3.0, 2.0, -1.0, -2.0], [False, False, True, True]) == 0.0
    assert script.auc([-1.0, -1.0, -1.0, -1.0], [True, False, True, False]) == 0.5  # always "no": a prior
    assert script.auc([1.0, 2.0], [True, True]) is None
