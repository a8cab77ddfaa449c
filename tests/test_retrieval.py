import json

import pytest

from rig_decode.config import RetrieverConfig
from rig_decode.retrieval.base import Document, RetrievalError
from rig_decode.retrieval.dense import DenseRetriever, Embedder, load_documents
from rig_decode.retrieval.factory import build_retriever, demo_corpus_path

DOCS = [
    Document("a", "Release 4.2.1 fixed error E1234, a TLS handshake timeout.", "Changelog 4.2.1", {"kind": "log"}),
    Document("b", "Priya Raman approved release 4.2.1 for production.", "Approval 4.2.1", {"kind": "approval"}),
    Document("c", "Bananas are rich in potassium and grow in the tropics.", "Fruit", {"kind": "misc"}),
]


@pytest.fixture(scope="module")
def embedder():
    return Embedder("all-minilm-l6-v2")


def test_search_batch_ranks_and_filters(embedder):
    r = DenseRetriever.build(DOCS, embedder)
    hits = r.search_batch(["who approved release 4.2.1", "tropical fruit potassium"], top_k=2)
    assert hits[0][0].doc_id == "b" and hits[1][0].doc_id == "c"
    assert hits[0][0].score >= hits[0][1].score
    only_logs = r.search_batch(["who approved release 4.2.1"], top_k=2, filters={"kind": "log"})
    assert [h.doc_id for h in only_logs[0]] == ["a"]


def test_score_threshold(embedder):
    r = DenseRetriever.build(DOCS, embedder, score_threshold=0.99)
    assert r.search_batch(["completely unrelated query about sailing"], top_k=3) == [[]]


def test_save_load_roundtrip_and_atomic_replace(tmp_path, embedder):
    r = DenseRetriever.build(DOCS, embedder)
    r.save(tmp_path / "idx")
    r.save(tmp_path / "idx")  # replacing an existing index works and leaves no temp dirs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"]
    loaded = DenseRetriever.load(tmp_path / "idx", embedder)
    assert loaded.search_batch(["TLS handshake"], 1)[0][0].doc_id == "a"


def test_missing_and_corrupt_index(tmp_path, embedder):
    with pytest.raises(RetrievalError, match="index not found"):
        DenseRetriever.load(tmp_path / "none", embedder)
    DenseRetriever.build(DOCS, embedder).save(tmp_path / "idx")
    data = (tmp_path / "idx" / "index.faiss").read_bytes()
    (tmp_path / "idx" / "index.faiss").write_bytes(data[: len(data) // 2])
    with pytest.raises(RetrievalError, match="corrupt or truncated"):
        DenseRetriever.load(tmp_path / "idx", embedder)
    (tmp_path / "idx" / "meta.json").unlink()
    with pytest.raises(RetrievalError, match="meta.json is missing"):
        DenseRetriever.load(tmp_path / "idx", embedder)


def test_bad_documents(tmp_path):
    p = tmp_path / "docs.jsonl"
    p.write_text('{"id": "a", "text": "ok"}\n{"id": "b"}\n')
    with pytest.raises(RetrievalError, match=r"docs.jsonl:2: field 'text'"):
        load_documents(p)
    p.write_text('{"id": "a", "text": "ok"}\nnot json\n')
    with pytest.raises(RetrievalError, match=r"docs.jsonl:2: invalid JSON"):
        load_documents(p)
    with pytest.raises(RetrievalError, match="empty corpus"):
        DenseRetriever.build([], None)


def test_missing_index_path_in_config(tmp_path):
    with pytest.raises(RetrievalError, match="index not found"):
        build_retriever(RetrieverConfig(index_path=str(tmp_path / "missing")))


def test_demo_corpus_answers_its_own_hops(tmp_path, embedder):
    docs = load_documents(demo_corpus_path())
    assert len(docs) >= 50
    assert all(json.dumps(d.metadata) for d in docs)
    r = build_retriever(RetrieverConfig(), cache_dir=tmp_path)
    hits = r.search_batch(["Which office does Priya Raman work from?"], top_k=3)[0]
    assert hits[0].doc_id == "person-priya"
    # A second call loads the index the first one saved instead of rebuilding it.
    assert len(list((tmp_path / "indexes").iterdir())) == 1
    again = build_retriever(RetrieverConfig(), cache_dir=tmp_path)
    assert again.index.ntotal == len(docs)
