"""The wide synthetic worlds: as wide as the issue asks, every answer stated by its documents, and
splits that hold out what they claim to (entities, phrasings, relations)."""

import collections
import json
import re
import subprocess
import sys

import pytest

from rig_decode.eval.world_questions import COMPARE_FRAMES, HELD_OUT_COMPARE, HELD_OUT_YESNO, YESNO_FRAMES
from rig_decode.eval.world_schema import (COMMON, ENTITY_KINDS, EXTRA_COMMON, EXTRA_FACT_FRAMES, EXTRA_QUESTION_FRAMES, FACT_FRAMES,
                                          HELD_OUT_FACT_FRAMES, HELD_OUT_QUESTION_FRAMES, HELD_OUT_RELATIONS,
                                          QUESTION_FRAMES, RELATIONS)
from rig_decode.eval.worlds import SPLITS, generate, write


@pytest.fixture(scope="module")
def bench():
    corpus, splits = generate(seed=0)
    return {d["id"]: d for d in corpus}, splits


def test_the_schema_is_as_wide_as_the_skill():
    assert len(RELATIONS) >= 30 and len(ENTITY_KINDS) >= 8
    kinds_used = {r.subject for r in RELATIONS} | {r.object for r in RELATIONS if r.is_link}
    assert kinds_used == set(ENTITY_KINDS)
    assert {r.object for r in RELATIONS if not r.is_link} >= {"year", "number", "amount", "role"}
    assert len(FACT_FRAMES) >= 8 and len(QUESTION_FRAMES) >= 6
    assert len(COMPARE_FRAMES) >= 6 and len(YESNO_FRAMES) >= 6
    for r in RELATIONS:  # every relation composes: some relation starts where a link ends, or it is a value
        assert "{o}" in r.pred and "{s}" in r.inv and "{o}" in r.inv and "{x}" in r.wh, r


def test_splits_have_their_sizes_and_hop_counts(bench):
    _, splits = bench
    assert [s.name for s in SPLITS] == list(splits)
    for name in ("test", "test_phrasings", "test_relations", "test_mixed"):
        qs = splits[name]
        assert len(qs) == 300, name
        kinds = collections.Counter(q["kind"] for q in qs)
        hops = collections.Counter(q["hops"] for q in qs if q["kind"] == "chain")
        assert set(hops) == {1, 2, 3, 4} and kinds["compare"] >= 20 and kinds["yesno"] >= 20, (name, kinds, hops)
        assert kinds["no_retrieval"] == 30 and len({q["question"] for q in qs}) == 300


def test_every_answer_is_stated_along_its_chain(bench):
    docs, splits = bench
    for name, qs in splits.items():
        for q in qs:
            assert q["supporting_docs"] == [p["doc"] for p in q["plan"]] and len(q["plan"]) == q["hops"]
            for p in q["plan"]:
                assert p["entity"] in docs[p["doc"]]["text"] and len(p["queries"]) == 3
            if q["kind"] == "chain":  # each hop's document names the next entity, the last the answer
                nxt = [p["entity"] for p in q["plan"][1:]] + [q["answer"]]
                for p, target in zip(q["plan"], nxt):  # ("The Fiskis crown" may open a sentence)
                    assert target.lower() in docs[p["doc"]]["text"].lower(), (name, q["question"], target)
            elif q["kind"] == "compare":
                assert q["answer"] in {p["entity"] for p in q["plan"]}
            elif q["kind"] == "yesno":
                assert q["answer"] in ("yes", "no")
            else:
                assert not q["needs_retrieval"] and q["hops"] == 0


def test_worlds_share_no_names_and_no_retrieval_lists_are_disjoint(bench):
    docs, splits = bench
    by_split = collections.defaultdict(set)
    for d in docs.values():
        by_split[d["metadata"]["split"]].add(d["title"])
    names = list(by_split.values())
    assert all(not (a & b) for i, a in enumerate(names) for b in names[i + 1:])
    no_search = {name: {q["question"] for q in qs if q["kind"] == "no_retrieval"} for name, qs in splits.items()}
    assert not (no_search["train"] & (no_search["test"] | no_search["dev"] | no_search["test_mixed"]))


def _frame_pattern(template: str) -> re.Pattern:
    """A fact frame as a regular expression over document text."""
    parts = re.split(r"\{[a-z_0-9]+\}", template)
    return re.compile(".+?".join(re.escape(p.strip()) for p in parts if p.strip()))


def test_training_worlds_never_show_held_out_relations_or_phrasings(bench):
    docs, splits = bench
    train_docs = [d["text"] for d in docs.values() if d["metadata"]["split"] in ("train", "dev")]
    held_rel = [r for r in RELATIONS if r.name in HELD_OUT_RELATIONS]
    for r in held_rel:  # "was mentored by", "is governed by mayor", ...
        verb = r.pred.split("{o}")[0].strip()
        assert not any(verb in t for t in train_docs), verb
    for frame in ("It is", "whose", "'s "):  # cleft, apposition, possessive frames
        assert not any(frame in t for t in train_docs), frame
    for q in splits["train"] + splits["dev"]:
        assert not set(q["relations"]) & set(HELD_OUT_RELATIONS)
        assert q["frame"] not in (*HELD_OUT_QUESTION_FRAMES, *HELD_OUT_COMPARE, *HELD_OUT_YESNO), q
    for name in ("test_relations", "test_mixed"):  # every question chains through a held-out relation
        assert all(set(q["relations"]) & set(HELD_OUT_RELATIONS) for q in splits[name] if q["hops"])
    for name in ("test_phrasings", "test_mixed"):
        assert all(q["frame"] in (*HELD_OUT_QUESTION_FRAMES, *HELD_OUT_COMPARE, *HELD_OUT_YESNO)
                   for q in splits[name] if q["hops"])
        texts = [d["text"] for d in docs.values() if d["metadata"]["split"] == name]
        seen = {f for f in FACT_FRAMES if any(_frame_pattern(FACT_FRAMES[f]).search(t) for t in texts)}
        assert seen >= set(HELD_OUT_FACT_FRAMES)


def test_distractors_share_names_and_words(bench):
    docs, _ = bench
    titles = [d["title"] for d in docs.values() if d["metadata"]["kind"] in ("company", "product", "person")]
    heads = collections.Counter(t.split()[0] for t in titles if not t.startswith(("Project", "University")))
    assert sum(n >= 2 for n in heads.values()) > 20  # families: Zentor X5 / Zentor X50, Korath Group / Korath Foundry
    assert any("Unlike " in d["text"] for d in docs.values())


def test_the_same_seed_writes_the_same_files(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    counts = write(a, seed=5, scale=0.4)
    assert write(b, seed=5, scale=0.4) == counts
    for name in ("corpus.jsonl", "train.jsonl", "test_mixed.jsonl"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert json.loads((a / "test.jsonl").read_text().splitlines()[0])["id"].startswith("test-")


def test_extra_phrasings_widen_only_the_training_worlds():
    """``--extra-phrasings`` adds training-only fact and question phrasings to the train and dev
    worlds; no held-out phrasing reaches them and the test worlds get none of the extra ones."""
    corpus, splits = generate(seed=5, scale=0.5, extra_phrasings=True)
    docs = {d["id"]: d for d in corpus}
    train_docs = [d["text"] for d in docs.values() if d["metadata"]["split"] in ("train", "dev")]
    test_docs = [d["text"] for d in docs.values() if d["metadata"]["split"].startswith("test")]
    extra = {f: re.compile("^" + re.sub(r"\\\{\w+\\\}", ".+?", re.escape(t)) + "$", re.I)
             for f, t in EXTRA_FACT_FRAMES.items()}

    def shown(texts):  # the extra frames whose sentences these documents hold
        sentences = [x for t in texts for x in re.split(r"(?<=\.) ", t)]
        return {f for f, p in extra.items() if any(p.match(x) for x in sentences)}

    assert shown(train_docs) == set(EXTRA_FACT_FRAMES) and not shown(test_docs)
    for frame in ("It is", "whose", "'s "):  # cleft, apposition, possessive frames
        assert not any(frame in t for t in train_docs), frame
    train_frames = {q["frame"] for q in splits["train"] + splits["dev"]}
    assert train_frames >= set(EXTRA_QUESTION_FRAMES)
    assert not train_frames & {*HELD_OUT_QUESTION_FRAMES, *HELD_OUT_COMPARE, *HELD_OUT_YESNO}
    assert not {q["frame"] for name in splits if name.startswith("test") for q in splits[name]} & set(EXTRA_QUESTION_FRAMES)
    assert not set(EXTRA_FACT_FRAMES) & set(FACT_FRAMES) and not set(EXTRA_QUESTION_FRAMES) & set(QUESTION_FRAMES)


def test_extra_no_search_questions_reach_only_the_training_world():
    """``--extra-no-search`` widens the train world's no-search questions past its twelve, with none
    of the dev or test worlds' questions, gives them to no other world and leaves every world else
    as it was."""
    questions = {q for q, _ in EXTRA_COMMON}
    assert len(questions) == len(EXTRA_COMMON) >= 100
    assert not questions & {q for name in ("train", "dev", "test") for q, _ in COMMON[name]}
    plain_corpus, plain = generate(seed=5, scale=0.5)
    corpus, wide = generate(seed=5, scale=0.5, extra_no_search=True)
    asked = {name: {q["question"] for q in qs if q["kind"] == "no_retrieval"} for name, qs in wide.items()}
    assert len(asked["train"] & questions) > len(COMMON["train"])
    assert not any(asked[name] & questions for name in asked if name != "train")
    assert corpus == plain_corpus and all(wide[name] == plain[name] for name in plain if name != "train")


def test_rig_synth_takes_the_extra_flags_for_the_wide_generator_only(tmp_path):
    def synth(*args):
        return subprocess.run([sys.executable, "-m", "rig_decode.cli", "synth", "--out", str(tmp_path / "w"),
                               "--scale", "0.4", *args], capture_output=True, text=True, timeout=300)

    for flag in ("--extra-no-search", "--extra-phrasings"):
        bad = synth(flag)
        assert bad.returncode != 0 and f"rig synth: {flag} needs --generator wide" in bad.stderr
    ok = synth("--generator", "wide", "--extra-no-search")
    assert ok.returncode == 0, ok.stderr[-2000:]
    asked = {json.loads(line)["question"] for line in (tmp_path / "w" / "train.jsonl").open()}
    assert asked & {q for q, _ in EXTRA_COMMON}
