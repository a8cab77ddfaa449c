"""The retrieval stack: tokeniser, filters, store, dense, lexical, hybrid, fallbacks, ingestion."""

import json
import time

import numpy as np
import pytest

from rig_decode.config import RetrieverConfig
from rig_decode.retrieval.base import Document, RetrievalError
from rig_decode.retrieval.dense import DenseSearcher, Embedder
from rig_decode.retrieval.factory import build_retriever, demo_corpus_path
from rig_decode.retrieval.filters import compile_filter, filter_mask
from rig_decode.retrieval.index_retriever import IndexRetriever
from rig_decode.retrieval.ingest import Chunking, build_index, chunk_document, load_documents, read_folder
from rig_decode.retrieval.store import IndexStore
from rig_decode.retrieval.text import exact_terms, tokenize

DOCS = [
    Document("log-421", "Release 4.2.1 fixed error E1234, a TLS handshake timeout.", "Changelog 4.2.1",
             {"kind": "log", "status": "active", "valid_until": "2099-01-01"}),
    Document("log-412", "Release 4.1.2 fixed error E1243 in the rate limiter.", "Changelog 4.1.2",
             {"kind": "log", "status": "superseded", "valid_until": "2020-01-01"}),
    Document("appr-421", "Priya Raman approved release 4.2.1 for production.", "Approval 4.2.1",
             {"kind": "approval", "status": "active"}),
    Document("fruit", "Bananas are rich in potassium and grow in the tropics.", "Fruit", {"kind": "misc"}),
    Document("zh-order", "订单号ORD-2024-001的包裹已经从上海仓库发货，预计三天内送达。", "订单状态", {"kind": "order"}),
]


@pytest.fixture(scope="module")
def embedder():
    return Embedder("all-minilm-l6-v2")


@pytest.fixture(scope="module")
def store(embedder, tmp_path_factory):
    path = tmp_path_factory.mktemp("idx") / "index"
    build_index(DOCS, embedder, path, progress=False)
    return IndexStore.load(path)


def ids(hits):
    return [h.doc_id for h in hits]


# -- tokeniser -------------------------------------------------------------------------------------

def test_tokenizer_keeps_codes_and_segments_chinese():
    toks = tokenize("Order ORD-2024-001 hit E1234 in v4.2.1")
    assert {"ord-2024-001", "e1234", "v4.2.1", "2024"} <= set(toks)
    zh = tokenize("订单号ORD-2024-001的发货状态")
    assert "ord-2024-001" in zh and "订单" in zh and "发货" in zh
    assert exact_terms('status of "blue widget" E1234 release 4.2.1') == ["E1234", "4.2.1", "blue widget"]
    assert exact_terms("who approved the release") == []


# -- filters ---------------------------------------------------------------------------------------

def test_filters():
    metas = [d.metadata for d in DOCS]
    fields = {k for m in metas for k in m}
    mask = filter_mask({"status": "active", "valid_until": {"gte": "today"}}, metas, fields)
    assert mask.tolist() == [True, False, False, False, False]  # appr-421 has no valid_until
    assert filter_mask({"kind": {"in": ["log", "order"]}}, metas, fields).sum() == 3
    assert compile_filter(None, fields) is None
    with pytest.raises(RetrievalError, match="unknown filter field 'stauts'"):
        compile_filter({"stauts": "active"}, fields)
    with pytest.raises(RetrievalError, match="unknown filter operator 'like'"):
        compile_filter({"status": {"like": "act"}}, fields)
    with pytest.raises(RetrievalError, match="needs a list"):
        compile_filter({"kind": {"in": "log"}}, fields)


# -- store -----------------------------------------------------------------------------------------

def test_store_roundtrip_and_stats(store):
    assert store.stats()["documents"] == 5 and store.dim == 384
    assert {"kind", "status", "valid_until"} <= store.metadata_fields


def test_store_bad_files(tmp_path, store):
    store.save(tmp_path / "i")
    with pytest.raises(RetrievalError, match="index not found"):
        IndexStore.load(tmp_path / "nope")
    emb = (tmp_path / "i" / "embeddings.npy").read_bytes()
    (tmp_path / "i" / "embeddings.npy").write_bytes(emb[: len(emb) // 2])
    with pytest.raises(RetrievalError, match="embeddings.npy is corrupt or truncated"):
        IndexStore.load(tmp_path / "i")
    store.save(tmp_path / "i")
    lines = (tmp_path / "i" / "chunks.jsonl").read_text().splitlines()
    (tmp_path / "i" / "chunks.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(RetrievalError, match="do not belong together"):
        IndexStore.load(tmp_path / "i")
    (tmp_path / "i" / "chunks.jsonl").write_text("{broken\n")
    with pytest.raises(RetrievalError, match="chunks.jsonl line 1 is corrupt"):
        IndexStore.load(tmp_path / "i")
    (tmp_path / "i" / "manifest.json").unlink()
    with pytest.raises(RetrievalError, match="manifest.json is missing"):
        IndexStore.load(tmp_path / "i")


def test_interrupted_save_keeps_the_previous_index(tmp_path, store, monkeypatch):
    store.save(tmp_path / "i")
    before = (tmp_path / "i" / "chunks.jsonl").read_text()
    bigger = IndexStore(store.chunks + store.chunks[:1], np.concatenate([store.embeddings, store.embeddings[:1]]),
                        store.manifest)

    def crash(*a, **k):
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(np, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        bigger.save(tmp_path / "i")
    assert (tmp_path / "i" / "chunks.jsonl").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["i"]  # no half-written temp dirs left
    assert len(IndexStore.load(tmp_path / "i").chunks) == len(store.chunks)


def test_dimension_mismatch(store, embedder):
    narrow = IndexStore(store.chunks, store.embeddings[:, :100].copy(), dict(store.manifest))
    with pytest.raises(RetrievalError, match="embedding-dimension mismatch"):
        IndexRetriever(narrow, embedder, "dense")
    with pytest.raises(RetrievalError, match="empty corpus"):
        DenseSearcher(np.zeros((0, 8), np.float32))


# -- dense / lexical / hybrid ----------------------------------------------------------------------

@pytest.mark.parametrize("index_type", ["flat", "hnsw", "ivf"])
def test_dense_index_types_and_filtered_depth(index_type):
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(400, 16)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    s = DenseSearcher(emb, index_type)
    hits = s.search(emb[:3], 5)
    assert [h[0][0] for h in hits] == [0, 1, 2]
    mask = np.zeros(400, bool)
    mask[::50] = True  # 8 allowed rows, far from most queries: the search must fetch deeper
    filtered = s.search(emb[:2], 5, mask)
    assert all(mask[i] for r in filtered for i, _ in r)
    # exact search must find 5 of the 8 allowed rows; approximate ones at least one
    assert all(len(r) == 5 if index_type == "flat" else len(r) >= 1 for r in filtered)


def test_query_embedding_cache(embedder):
    e = Embedder("all-minilm-l6-v2", cache_size=2)
    a = e.encode_queries(["alpha", "beta", "alpha"])
    assert np.allclose(a[0], a[2]) and e.cache_misses == 2 and e.cache_hits == 1
    e.encode_queries(["gamma", "alpha"])  # gamma evicts beta (LRU)
    e.encode_queries(["beta"])
    assert e.cache_misses == 4 and 0 < e.cache_hit_rate < 1


def test_modes_and_router(store, embedder):
    dense = IndexRetriever(store, embedder, "dense")
    lexical = IndexRetriever(store, None, "lexical")
    hybrid = IndexRetriever(store, embedder, "hybrid")
    q = "error E1243"
    assert ids(lexical.search_batch([q], 1)[0]) == ["log-412"]
    res = hybrid.search_batch([q, "who signed off the newest release"], 2)
    assert ids(res[0])[0] == "log-412"
    assert "exact terms ['E1243']" in res[0].info["router"] and res[0].info["alpha"] == 0.3
    assert "router" not in res[1].info and res[1].info["alpha"] == 0.7
    assert {h.source for h in res[0]} <= {"dense", "bm25", "hybrid"}
    assert ids(lexical.search_batch(["ORD-2024-001 发货"], 1)[0]) == ["zh-order"]
    assert ids(dense.search_batch(["tropical fruit"], 1)[0]) == ["fruit"]
    rrf = IndexRetriever(store, embedder, "hybrid", fusion="rrf")
    assert ids(rrf.search_batch([q], 1)[0]) == ["log-412"]


def test_misspelled_query_words_are_corrected_to_indexed_words(store, embedder):
    """A word the index lacks is replaced by the closest indexed word when similar enough; codes,
    numbers, stop words and words with no close match stay as written; the trace names each fix."""
    off = IndexRetriever(store, None, "lexical")
    assert off.search_batch(["Ramen"], 1)[0] == []  # without typo tolerance: no match
    lexical = IndexRetriever(store, None, "lexical", typo_similarity=0.8)
    assert ids(lexical.search_batch(["Ramen"], 1)[0]) == ["appr-421"]
    res = lexical.search_batch(["who approved Priya Ramen", "Bananes potassum", "E1243 zzzzqx"], 1)
    assert ids(res[0]) == ["appr-421"] and res[0].info["corrected"] == {"Ramen": "Raman"}
    assert ids(res[1]) == ["fruit"] and res[1].info["corrected"] == {"Bananes": "Bananas", "potassum": "potassium"}
    assert ids(res[2]) == ["log-412"] and "corrected" not in res[2].info  # E1243 indexed, zzzzqx far from all
    assert lexical.lexical.corrections("E1244 release 4.2.9", 0.8) == {}  # codes and numbers are exact
    assert lexical.lexical.corrections("Bananes", 0.99) == {}  # below the similarity asked for
    # the gate asks whether a search could find a term: a correctable word counts
    assert lexical.knows("Priya Ramen") and not off.knows("Priya Ramen") and not lexical.knows("Ramen zzzzqx")
    hybrid = IndexRetriever(store, embedder, "hybrid", typo_similarity=0.8)
    res = hybrid.search_batch(["who approved Priya Ramen"], 1)[0]
    assert ids(res) == ["appr-421"] and res.info["corrected"] == {"Ramen": "Raman"}


def test_filters_through_the_retriever(store, embedder):
    r = IndexRetriever(store, embedder, "hybrid", default_filters={"status": "active"})
    assert set(ids(r.search_batch(["release fixed error"], 5)[0])) <= {"log-421", "appr-421"}
    with pytest.raises(RetrievalError, match="unknown filter field"):
        r.search_batch(["x"], 2, filters={"colour": "red"})


def test_fallback_chain(store, embedder, monkeypatch):
    r = IndexRetriever(store, embedder, "hybrid", timeout_s=0.5)

    def broken(*a, **k):
        raise ConnectionError("GPU fell off the bus")

    monkeypatch.setattr(r.dense, "search", broken)
    res = r.search_batch(["error E1234"], 2)[0]
    assert ids(res)[0] == "log-421" and "dense search failed" in res.info["fallback"]
    assert res.info["fallback"].endswith("lexical only")
    monkeypatch.setattr(r.dense, "search", lambda *a, **k: time.sleep(2))
    res = r.search_batch(["error E1234"], 2)[0]
    assert "dense search timed out" in res.info["fallback"] and ids(res)
    monkeypatch.setattr(r.lexical, "search", broken)
    res = r.search_batch(["error E1234"], 2)[0]
    assert list(res) == [] and res.info["empty"] and "empty result" in res.info["fallback"]


# -- ingestion -------------------------------------------------------------------------------------

def test_chunking_english_and_cjk():
    words = " ".join(f"w{i}" for i in range(500))
    chunks = chunk_document(Document("d", words), Chunking(words=200, overlap=0.15))
    assert [len(c.text.split()) for c in chunks] == [200, 200, 160]  # starts at 0, 170, 340
    assert chunks[0].text.split()[-30:] == chunks[1].text.split()[:30]  # 15% overlap
    zh = "订单" * 450
    zc = chunk_document(Document("z", zh), Chunking(chars=400, overlap=0.1))
    assert len(zc[0].text) == 400 and zc[0].text[-40:] == zc[1].text[:40]
    assert [c.id for c in zc] == ["z#0", "z#1", "z#2"]


def test_folder_ingestion_incremental_and_delete(tmp_path, embedder):
    src = tmp_path / "docs"
    src.mkdir()
    (src / "a.md").write_text("---\nid: policy-a\nstatus: active\nvalid_until: 2030-01-01\n---\n# Policy A\n\nRefunds within 30 days.")
    (src / "b.txt").write_text("Shipping takes three days.")
    (src / "c.jsonl").write_text(json.dumps({"id": "c1", "text": "Order ORD-1 shipped.", "metadata": {"x": 1}}) + "\n")
    (src / "ignored.bin").write_bytes(b"\x00\x01")
    docs = read_folder(src)
    assert sorted(d.doc_id for d in docs) == ["b", "c1", "policy-a"]
    a = next(d for d in docs if d.doc_id == "policy-a")
    assert a.title == "Policy A" and a.metadata == {"status": "active", "valid_until": "2030-01-01"}
    out = tmp_path / "index"
    r1 = build_index(docs, embedder, out, progress=False)
    assert r1["documents"] == 3 and r1["embedded_chunks"] == 3
    (src / "b.txt").write_text("Shipping takes five days now.")
    r2 = build_index(read_folder(src), embedder, out, progress=False)
    assert r2["embedded_chunks"] == 1 and r2["reused_embeddings"] == 2 and r2["documents"] == 3
    r3 = build_index([], embedder, out, delete=["c1"], progress=False)
    assert r3["documents"] == 2
    store = IndexStore.load(out)
    assert "five days" in next(c.text for c in store.chunks if c.doc_id == "b")
    with pytest.raises(RetrievalError, match="nothing to index"):
        build_index([], embedder, tmp_path / "empty", progress=False)


def test_bad_documents(tmp_path):
    p = tmp_path / "docs.jsonl"
    p.write_text('{"id": "a", "text": "ok"}\n{"id": "b"}\n')
    with pytest.raises(RetrievalError, match=r"docs.jsonl:2: field 'text'"):
        load_documents(p)
    p.write_text('{"id": "a", "text": "ok"}\n{"id": "a", "text": "again"}\n')
    with pytest.raises(RetrievalError, match="duplicate document id 'a'"):
        load_documents(p)
    (tmp_path / "bad.md").write_text("---\n[unclosed\n---\ntext")
    with pytest.raises(RetrievalError, match="invalid front matter"):
        read_folder(tmp_path / "bad.md")


# -- configuration -----------------------------------------------------------------------------------

def test_default_config_finds_codes_in_the_demo_corpus(tmp_path):
    r = build_retriever(RetrieverConfig(), cache_dir=tmp_path)
    assert len(load_documents(demo_corpus_path())) >= 50
    assert ids(r.search_batch(["release 4.2.1 approval"], 3)[0])[0] == "approval-4.2.1"
    assert "changelog-4.2.1" in ids(r.search_batch(["error E1234 fixed in release"], 3)[0])
    assert len(list((tmp_path / "indexes").iterdir())) == 1
    build_retriever(RetrieverConfig(), cache_dir=tmp_path)  # loads the cached index, builds nothing new
    assert len(list((tmp_path / "indexes").iterdir())) == 1


def test_missing_index_path_in_config(tmp_path):
    with pytest.raises(RetrievalError, match="index not found"):
        build_retriever(RetrieverConfig(index_path=str(tmp_path / "missing")))
