"""scripts/convert_multihop.py on tiny HotpotQA- and MuSiQue-shaped inputs written here (no network, no real data)."""

import copy
import hashlib
import json
import subprocess

import pytest

from rig_decode.eval.datasets import load_dataset
from rig_decode.retrieval.ingest import load_documents
from rig_decode.train.data import hop_plan

from .helpers import load_script

HOTPOT = [
    {"_id": "h1", "type": "bridge", "level": "medium", "answer": "Mara Quell",
     "question": "Who founded the label that released the album Blue Tides?",
     "supporting_facts": [["Corvid Records", 1], ["Blue Tides", 1]],  # not in the order a reader needs them
     "context": [["Red Tides", ["Red Tides is a 2006 album by Vessel Nine."]],
                 ["Corvid Records", ["Corvid Records is a record label.", " It was founded by Mara Quell in 1990."]],
                 ["Blue Tides", ["Blue Tides is a 2004 album by Sonder.", " It was released by Corvid Records."]]]},
    {"_id": "h2", "type": "comparison", "level": "easy", "answer": "Sonder",
     "question": "Which band was formed first, Vessel Nine or Sonder?",
     "supporting_facts": [["Sonder (band)", 0], ["Vessel Nine", 0]],
     "context": [["Sonder (band)", ["Sonder is an indie band formed in 1998 in Leeds."]],
                 ["Vessel Nine", ["Vessel Nine is a rock band formed in 2003."]]]},
]
MUSIQUE = [
    {"id": "2hop__1_2", "answerable": True, "answer": "1998", "answer_aliases": [],
     "question": "When was the performer of Blue Tides formed?",
     "question_decomposition": [{"id": 1, "question": "Blue Tides >> performer", "answer": "Sonder",
                                 "paragraph_support_idx": 1},
                                {"id": 2, "question": "When was #1 formed?", "answer": "1998", "paragraph_support_idx": 2}],
     "paragraphs": [{"idx": 0, "title": "Red Tides", "paragraph_text": "Red Tides is a painting.", "is_supporting": False},
                    {"idx": 1, "title": "Blue Tides (album)", "paragraph_text": "Blue Tides is a 2004 album by the band Sonder.",
                     "is_supporting": True},
                    {"idx": 2, "title": "Sonder (band)", "paragraph_text": "Sonder is an indie band formed in 1998 in Leeds.",
                     "is_supporting": True}]},
    {"id": "2hop__3_4", "answerable": True, "answer": "Ada Brix", "answer_aliases": [],
     "question": "Who runs the record label of Sonder?",
     "question_decomposition": [{"id": 3, "question": "Sonder >> record label", "answer": "Corvid Records",
                                 "paragraph_support_idx": 0},
                                {"id": 4, "question": "Who runs #1?", "answer": "Ada Brix", "paragraph_support_idx": 1}],
     "paragraphs": [{"idx": 0, "title": "Sonder (band)", "paragraph_text": "Sonder is an indie band signed to Corvid Records.",
                     "is_supporting": True},
                    {"idx": 1, "title": "Corvid Records", "paragraph_text": "Corvid Records is run by Ada Brix.",
                     "is_supporting": True}]},
]


@pytest.fixture(scope="module")
def convert():
    return load_script("scripts/convert_multihop.py")


def _raw(folder, hotpot, musique):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hotpotqa_train.json").write_text(json.dumps(hotpot))
    (folder / "musique_train.json").write_text(json.dumps(musique))
    return folder


def _run(convert, source, out, capsys):
    assert convert.main(["--source", str(source), "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    recs = [json.loads(line) for line in (out / "train.jsonl").open()]
    return {r["id"]: r for r in recs}, printed


def test_records_plans_and_corpus(convert, tmp_path, capsys):
    raw = _raw(tmp_path / "raw", HOTPOT, MUSIQUE)
    recs, printed = _run(convert, raw, tmp_path / "out", capsys)
    assert set(recs) == {"hotpotqa-h1", "hotpotqa-h2", "musique-2hop__1_2"}
    # musique 2hop__3_4 needs "Corvid Records", whose title HotpotQA's paragraph of another text holds
    assert printed["dropped"] == {"musique: a gold paragraph's title holds another text": 1}

    bridge = recs["hotpotqa-h1"]
    assert bridge["kind"] == "chain" and bridge["template"] == "hotpotqa:bridge" and bridge["hops"] == 2
    assert bridge["supporting_docs"] == ["Blue Tides", "Corvid Records"] and bridge["needs_retrieval"] is True
    assert [p["doc"] for p in bridge["plan"]] == bridge["supporting_docs"]
    assert [p["entity"] for p in bridge["plan"]] == bridge["entities"] == ["Blue Tides", "Corvid Records"]
    first, second = bridge["plan"]
    assert 2 <= len(first["queries"]) <= 3 and 2 <= len(second["queries"]) <= 3
    # hop 1 searches from the question only; hop 2 from the bridge entity hop 1's paragraph names
    assert not any("corvid" in q.lower() or "mara" in q.lower() for q in first["queries"])
    assert all(q.startswith("Corvid Records") and "Mara" not in q for q in second["queries"])
    assert "founded" in second["queries"][0]

    compare = recs["hotpotqa-h2"]
    assert compare["kind"] == "compare" and compare["template"] == "hotpotqa:comparison"
    assert compare["supporting_docs"] == ["Vessel Nine", "Sonder (band)"]  # in the question's order
    assert compare["entities"] == ["Vessel Nine", "Sonder"]
    for p in compare["plan"]:
        assert all(q.startswith(p["entity"]) for q in p["queries"]) and any("formed" in q for q in p["queries"])

    mus = recs["musique-2hop__1_2"]
    assert mus["kind"] == "chain" and mus["template"] == "musique:2hop"
    assert mus["supporting_docs"] == ["Blue Tides (album)", "Sonder (band)"] and mus["entities"] == ["Blue Tides", "Sonder"]
    assert mus["plan"][0]["queries"] == ["performer of Blue Tides", "Blue Tides performer"]
    assert mus["plan"][1]["queries"] == ["When was Sonder formed", "Sonder formed"]  # #1 replaced by hop 1's answer
    for r in recs.values():
        assert [h[1] for h in hop_plan(r)] == [p["doc"] for p in r["plan"]]

    docs = load_documents(tmp_path / "out" / "corpus.jsonl")
    by_id = {d.doc_id: d for d in docs}
    assert len(by_id) == len(docs) == 6  # titles deduplicated across records and datasets
    assert by_id["Corvid Records"].text == "Corvid Records is a record label. It was founded by Mara Quell in 1990."
    assert by_id["Red Tides"].text == "Red Tides is a 2006 album by Vessel Nine."  # the first text of a title
    assert by_id["Blue Tides"].title == "Blue Tides" and by_id["Blue Tides"].metadata["source"] == "hotpotqa"
    examples, corpus = load_dataset(tmp_path / "out" / "train.jsonl")  # what make_marker_data reads
    assert len(examples) == 3 and len(corpus) == 6
    assert all(d in by_id for r in recs.values() for d in r["supporting_docs"])

    source = json.loads((tmp_path / "out" / "SOURCE.json").read_text())
    for name, fname, lic, kept in (("hotpotqa", "hotpotqa_train.json", "CC BY-SA 4.0", 2),
                                   ("musique", "musique_train.json", "CC BY 4.0", 1)):
        meta = source["datasets"][name]
        assert meta["sha256"] == hashlib.sha256((raw / fname).read_bytes()).hexdigest()
        assert (meta["records"], meta["kept"], meta["license"]) == (2, kept, lic)
        assert meta["repository"] == "OSU-NLP-Group/HippoRAG" and meta["commit"] == convert.COMMIT
        assert meta["path"] == f"data/{fname}" and meta["split"] == "train"


def test_drops_answers_the_evidence_does_not_hold(convert, tmp_path, capsys):
    hotpot, musique = copy.deepcopy(HOTPOT), copy.deepcopy(MUSIQUE[:1])
    hotpot[0]["answer"] = "Ivo Marsh"  # in neither paragraph
    hotpot[1]["answer"] = "the 1990s"  # neither yes/no nor a compared band
    musique[0]["answer"] = "1999"  # not in the last hop's paragraph
    recs, printed = _run(convert, _raw(tmp_path / "raw", hotpot, musique), tmp_path / "out", capsys)
    assert recs == {}
    assert printed["dropped"] == {"hotpotqa bridge: answer not in its paragraph": 1, "musique: answer not in its paragraph": 1,
                                  "hotpotqa comparison: answer neither yes/no nor a compared entity": 1}
    hotpot[1]["answer"] = "yes"
    hotpot[0]["answer"] = "Mara Quell"  # but no text names the label, and the question names neither title:
    hotpot[0]["question"] = "Who founded the label that released the 2004 album by Sonder?"
    hotpot[0]["context"][2][1] = ["Blue Tides is a 2004 album by Sonder.", " It was released by an Irish label."]
    recs, printed = _run(convert, _raw(tmp_path / "raw", hotpot, musique), tmp_path / "out", capsys)
    assert set(recs) == {"hotpotqa-h2"} and printed["dropped"]["hotpotqa bridge: no bridge entity named"] == 1


def test_reads_a_git_directory_at_the_pinned_commit(convert, tmp_path, capsys, monkeypatch):
    repo = tmp_path / "repo"
    _raw(repo / "data", HOTPOT, MUSIQUE)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(git + ["add", "data"], check=True)
    subprocess.run(git + ["commit", "-qm", "data"], check=True)
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run(["git", "clone", "-q", "--bare", str(repo), str(tmp_path / "bare.git")], check=True)
    monkeypatch.setattr(convert, "COMMIT", head)
    recs, _ = _run(convert, tmp_path / "bare.git", tmp_path / "out", capsys)
    assert len(recs) == 3
    with pytest.raises(SystemExit, match="neither"):
        convert.main(["--source", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out2")])
