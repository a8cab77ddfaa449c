import json
import warnings
from collections import Counter

import pytest

from rig_decode.eval.datasets import DatasetError, load_dataset
from rig_decode.eval.synth import CONVERSATION_KINDS, generate, held_out_names, write


def test_jsonl_dataset_and_sibling_corpus(tmp_path):
    (tmp_path / "q.jsonl").write_text(
        '{"id": "a", "question": "Q1?", "answer": "x", "supporting_docs": ["d1"], "needs_retrieval": true}\n'
        '\n{"question": "Q2?", "answers": ["y", "z"], "hops": 0, "needs_retrieval": false}\n')
    (tmp_path / "corpus.jsonl").write_text('{"id": "d1", "text": "x is here"}\n')
    ex, corpus = load_dataset(tmp_path / "q.jsonl")
    assert [e.id for e in ex] == ["a", "1"] and ex[1].answers == ["y", "z"] and ex[1].hops == 0
    assert [d.doc_id for d in corpus] == ["d1"]


def test_questions_whose_documents_the_corpus_lacks_are_named(tmp_path):
    """A question file beside another world's corpus (or a mix of worlds) would score its
    retrieval 0 without a word: the loader says how many questions it affects."""
    (tmp_path / "corpus.jsonl").write_text('{"id": "d1", "text": "x is here"}\n')
    (tmp_path / "q.jsonl").write_text('{"question": "Q1?", "answer": "x", "supporting_docs": ["d1"]}\n'
                                      '{"question": "Q2?", "answer": "y", "supporting_docs": ["gone", "elsewhere"]}\n')
    with pytest.warns(UserWarning, match=r"1 of 2 questions .* name supporting documents that .* does not hold"):
        load_dataset(tmp_path / "q.jsonl")
    (tmp_path / "ok.jsonl").write_text('{"question": "Q1?", "answer": "x", "supporting_docs": ["d1"]}\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_dataset(tmp_path / "ok.jsonl")


@pytest.mark.parametrize("line, msg", [
    ('{"answer": "x"}', "line 1 field 'question'"),
    ('{"question": "q"}', "needs 'answer'"),
    ('{"question": "q", "answers": []}', "answers must be non-empty"),
    ('{"question": "q", "answer": "a", "supporting_docs": "d1"}', "'supporting_docs' must be a list"),
    ('{"question": "q", "answer": "a", "needs_retrieval": "yes"}', "'needs_retrieval' must be true or false"),
    ("not json", "invalid JSON"),
])
def test_bad_records_name_line_and_field(tmp_path, line, msg):
    p = tmp_path / "q.jsonl"
    p.write_text(line + "\n")
    with pytest.raises(DatasetError) as e:
        load_dataset(p)
    assert f"{p}:1" in str(e.value) and msg.replace("line 1 ", "") in str(e.value)


def test_hotpot_records_become_a_corpus(tmp_path):
    recs = [
        {"id": "h1", "question": "Q?", "answer": "A", "type": "bridge",
         "supporting_facts": [["T1", 0], ["T2", 1], ["T1", 1]],
         "context": [["T1", ["s1.", "s2."]], ["T2", ["u1.", "u2."]], ["T3", ["v."]]]},
        {"id": "h2", "question": "R?", "answer": "B", "supporting_facts": [["T3", 0]],
         "context": [["T3", ["v."]], ["T4", ["w."]]]},
    ]
    p = tmp_path / "h.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in recs))
    ex, corpus = load_dataset(p)
    assert ex[0].supporting_docs == ["T1", "T2"] and ex[0].hops == 2
    assert sorted(d.doc_id for d in corpus) == ["T1", "T2", "T3", "T4"]
    assert next(d for d in corpus if d.doc_id == "T1").text == "s1. s2."
    p.write_text(json.dumps({"question": "q", "answer": "a", "supporting_facts": [], "context": "x"}))
    with pytest.raises(DatasetError, match="must be lists"):
        load_dataset(p)


def test_shared_dev_subset_loads():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "shared" / "data" / "hotpotqa_dev_100.jsonl"
    if not path.is_file():
        pytest.skip("shared data not present")
    ex, corpus = load_dataset(path)
    assert len(ex) == 100 and 900 <= len(corpus) <= 1000
    ids = {d.doc_id for d in corpus}
    assert all(set(e.supporting_docs) <= ids for e in ex)


def test_synthetic_splits_share_no_entities_and_chains_hold():
    corpus, splits = generate(seed=3, scale=0.4)
    docs = {d["id"]: d for d in corpus}
    titles = {d["title"] for d in corpus}  # entities; years and other values are shared on purpose
    entities = {s: {e for q in qs for e in q.entities if e in titles} for s, qs in splits.items()}
    assert all(entities.values())
    assert not (entities["train"] & entities["test"]) and not (entities["dev"] & entities["test"])
    assert not (entities["train"] & entities["dev"])
    for qs in splits.values():
        assert len({q.id for q in qs}) == len(qs)
        for q in qs:
            assert q.hops == len(q.supporting_docs) and q.needs_retrieval == (q.hops > 0)
            for d in q.supporting_docs:
                assert docs[d]["metadata"]["split"] == q.split
            if q.hops:  # each document names the next entity of the chain; the last names the answer
                for d, nxt in zip(q.supporting_docs, q.entities[1:]):
                    assert nxt in docs[d]["text"]
    assert Counter(q.hops for q in splits["test"]).keys() == {0, 1, 2, 3}


def test_synthetic_is_seeded_and_has_distractors(tmp_path):
    a, b = write(tmp_path / "a", seed=1, scale=0.4), write(tmp_path / "b", seed=1, scale=0.4)
    assert a == b and (tmp_path / "a" / "test.jsonl").read_text() == (tmp_path / "b" / "test.jsonl").read_text()
    corpus = [json.loads(x) for x in (tmp_path / "a" / "corpus.jsonl").read_text().splitlines()]
    products = [d["title"] for d in corpus if d["metadata"]["kind"] == "product"]
    brands = Counter(p.split()[0] for p in products)
    assert max(brands.values()) >= 2  # product families: same brand, model numbers one digit apart
    default = generate(seed=0)[1]
    assert len(default["test"]) >= 300


def test_held_out_names_are_the_dev_and_test_entities(tmp_path):
    write(tmp_path, seed=2, scale=0.4)
    names = held_out_names(tmp_path)
    named = {s: {e for line in (tmp_path / f"{s}.jsonl").read_text().splitlines()
                 for e in json.loads(line)["entities"] if not e.isdigit()} for s in ("train", "dev", "test")}
    assert named["dev"] | named["test"] <= names and not named["train"] & names


def test_synthetic_conversations_answers_lie_in_their_documents():
    chats: dict = {}
    corpus, _ = generate(seed=3, scale=0.4, conversations=chats)
    docs = {d["id"]: d for d in corpus}
    for conv in chats["test"]:
        kinds = [t["kind"] for t in conv["turns"]]
        assert kinds == list(CONVERSATION_KINDS)
        lookup, clarify, detail, follow, _ = conv["turns"]
        assert clarify["answers"] == lookup["answers"] and not clarify["needs_retrieval"]
        # the detail is answered by the very document the lookup needed; the follow-up needs a new one
        assert detail["supporting_docs"] == lookup["supporting_docs"] != follow["supporting_docs"]
        for t in (lookup, detail, follow):
            assert t["needs_retrieval"] and t["answers"][0] in docs[t["supporting_docs"][0]]["text"]
        assert lookup["answers"][0] in docs[follow["supporting_docs"][0]]["title"]
