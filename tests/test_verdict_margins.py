"""scripts/verdict_margins.py: the two answers of a verdict, the values it rests on, the AUC of a
margin, and answer log-probabilities from one run of the prefix."""

import pytest
import torch

from rig_decode.eval import worlds

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


def test_the_restatement_says_the_values_the_documents_state():
    corpus, splits = worlds.generate(seed=5, scale=0.5)
    text = {d["id"]: d["text"].lower() for d in corpus}
    records = [r for qs in splits.values() for r in qs]
    for r in records:  # every hop's value is what its document says
        assert all(p["value"].lower() in text[p["doc"]] for p in r["plan"]), r
    by_kind = {}
    for r in records:
        if r["kind"] in ("compare", "yesno"):
            by_kind.setdefault(script.kind(r), r)
    assert set(by_kind) == set(script.KINDS)
    for k, r in by_kind.items():
        said = script.restatement(r)
        assert said.endswith(". So the answer is") and said.count(". ") == (1 if k == "yes/no, one chain" else 2)
        ends = [r["plan"][-1]] if k == "yes/no, one chain" else [r["plan"][len(r["plan"]) // 2 - 1], r["plan"][-1]]
        assert all(f"of {p['entity']} is {p['value']}." in said for p in ends)
        if k == "comparison":  # the compared entities are the ones whose values are said
            assert [p["entity"] for p in ends] == list(script.candidates(r))


def test_answer_logprobs_from_one_prefix_run_equal_full_forwards(model, tok):
    prefix = tok.encode("Which release fixed error E1234 and who approved it?")
    answers = [tok.encode(" Release 4.2.1 fixed"), tok.encode("No")[:1], tok.encode(" Priya Raman")]
    assert len(answers[0]) > 2 and len(answers[1]) == 1  # many tokens, one (no cache to cut back), many

    def full(answer):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prefix + answer])).logits[0, len(prefix) - 1:-1].float()
        return float(logits.log_softmax(-1).gather(1, torch.tensor(answer)[:, None]).sum())

    got = script.answer_logprobs(model, prefix, answers)  # the cache is cut back after each answer
    assert got == pytest.approx([full(a) for a in answers], abs=1e-4)


def test_scores_are_grouped_by_kind_and_by_one_search(model, tok):
    plan = [{"entity": "Loyein Initiative", "relation": "budget", "value": "$8.1 million"},
            {"entity": "Project Jeagreim", "relation": "budget", "value": "$19.4 million"}]
    records = {
        "c": {"kind": "compare", "template": "compare:budget", "entities": ["Loyein Initiative", "Project Jeagreim"],
              "answer": "Loyein Initiative", "plan": plan},
        "s": {"kind": "yesno", "template": "same:budget", "entities": ["Loyein Initiative", "Project Jeagreim"],
              "answer": "no", "plan": plan},
        "y": {"kind": "yesno", "template": "budget", "entities": ["Loyein Initiative"], "answer": "yes",
              "plan": plan[:1]},
    }
    ids = tok.encode("Which release fixed error E1234 and who approved it?")
    traces = [{"id": i, "kind": k, "input_ids": ids + [5], "mask": [0] * len(ids) + [1]}
              for i, k in (("c", "one_search"), ("s", "plain"), ("y", "plain"), ("c", "plain"))]
    for restate in (False, True):
        got = script.score(model, tok, [(t, records[t["id"]]) for t in traces], restate=restate)
        assert {k: r["n"] for k, r in got.items()} == {"comparison": 1, "comparison, one search": 1,
                                                      "yes/no, two chains": 1, "yes/no, one chain": 1}
        assert all(r["auc"] is None and r["right"] in (0.0, 1.0) for r in got.values())  # one answer: no AUC
    assert script.restatement(records["y"]) == " The budget of Loyein Initiative is $8.1 million. So the answer is"


def test_each_traces_file_needs_its_world(tmp_path, capsys):
    with pytest.raises(SystemExit):
        script.main(["--traces", "a.jsonl", "--traces", "b.jsonl", "--synth", str(tmp_path), "--adapter", "auto"])
    assert "2 --traces but 1 --synth" in capsys.readouterr().err
