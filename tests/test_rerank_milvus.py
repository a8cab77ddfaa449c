"""flashrank adapter (with a tiny ONNX model the test builds in flashrank's layout), the latency
budget, and the Milvus backend on embedded Milvus Lite."""

import json
import shutil

import numpy as np
import pytest

from rig_decode.retrieval.base import Hit, HitList, RetrievalError
from rig_decode.retrieval.dense import Embedder, resolve_embedder
from rig_decode.retrieval.rerank import FlashRankReranker, RerankingRetriever
from rig_decode.retrieval.store import Chunk

MODEL = "ms-marco-TinyBERT-L-2-v2"


def _tiny_cross_encoder(folder, token_id: int, onnx_name: str = "flashrank-TinyBERT-L-2-v2.onnx"):
    """An ONNX 'cross-encoder' whose logit counts ``token_id`` in the passage segment, in
    flashrank's layout (``onnx_name`` is the model file's name)."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    ins = [helper.make_tensor_value_info(n, TensorProto.INT64, ["b", "s"])
           for n in ("input_ids", "attention_mask", "token_type_ids")]
    out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", 1])
    nodes = [
        helper.make_node("Constant", [], ["target"], value=helper.make_tensor("t", TensorProto.INT64, [], [token_id])),
        helper.make_node("Equal", ["input_ids", "target"], ["hit"]),
        helper.make_node("Cast", ["hit"], ["hitf"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["token_type_ids"], ["segf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["hitf", "segf"], ["inpassage"]),
        helper.make_node("Constant", [], ["axes"], value=helper.make_tensor("a", TensorProto.INT64, [1], [1])),
        helper.make_node("ReduceSum", ["inpassage", "axes"], ["count"], keepdims=1),
        helper.make_node("Constant", [], ["half"], value=helper.make_tensor("h", TensorProto.FLOAT, [], [0.5])),
        helper.make_node("Sub", ["count", "half"], ["logits"]),
    ]
    graph = helper.make_graph(nodes, "tiny_ce", ins, [out])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder.mkdir(parents=True)
    onnx.save(model, str(folder / onnx_name))
    src = resolve_embedder("all-minilm-l6-v2")  # a BERT WordPiece tokenizer in the layout flashrank reads
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
        shutil.copy(f"{src}/{name}", folder / name)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.setdefault("model_max_length", 512)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    pytest.importorskip("flashrank")
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("rerankers")
    tok = Tokenizer.from_file(f"{resolve_embedder('all-minilm-l6-v2')}/tokenizer.json")
    _tiny_cross_encoder(root / MODEL, tok.token_to_id("banana"))
    return FlashRankReranker(MODEL, root)


HITS = [Hit(f"d{i}", text, 1.0 - i / 10) for i, text in
        enumerate(["apples are red", "a banana is yellow", "banana banana bread", "grapes"])]


def test_flashrank_adapter_reorders_by_the_model(reranker):
    ranked = reranker.rerank("which fruit", HITS, top_n=2)
    assert [h.doc_id for h in ranked] == ["d2", "d1"]  # two 'banana's beat one
    assert ranked[0].metadata["fusion_score"] == pytest.approx(0.8) and ranked[0].score > ranked[1].score


def test_missing_reranker_model_is_not_downloaded(tmp_path):
    pytest.importorskip("flashrank")
    with pytest.raises(RetrievalError, match="reranker model not found"):
        FlashRankReranker(MODEL, tmp_path)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RetrievalError, match="unknown flashrank model"):
        FlashRankReranker("gpt-reranker", tmp_path)


class _Base:
    def search_batch(self, queries, top_k, filters=None):
        return [HitList(HITS[:top_k], {"mode": "test"}) for _ in queries]


def test_reranking_retriever_budget_and_failure(reranker):
    r = RerankingRetriever(_Base(), reranker, top_n=2, candidates=4, budget_ms=10_000)
    res = r.search_batch(["q1", "q2"], 3)
    assert [h.doc_id for h in res[0]] == ["d2", "d1"] and "4 -> 2" in res[0].info["rerank"]
    assert res[0].info["mode"] == "test"
    r.ms_per_passage = 100.0  # now predicted at 400 ms for 4 passages
    r.budget_ms = 50
    res = r.search_batch(["q"], 3)[0]
    assert [h.doc_id for h in res] == ["d0", "d1"] and "over budget" in res.info["fallback"]

    class Broken:
        def rerank(self, *a):
            raise RuntimeError("onnx session died")

    res = RerankingRetriever(_Base(), Broken(), top_n=2).search_batch(["q"], 3)[0]
    assert [h.doc_id for h in res] == ["d0", "d1"] and "failed" in res.info["rerank"]


def test_milvus_lite_backend(tmp_path):
    pytest.importorskip("pymilvus")
    from rig_decode.retrieval.milvus import MilvusRetriever, filter_expression

    emb = Embedder()
    with pytest.raises(RetrievalError, match="collection 'c' not found"):
        MilvusRetriever(str(tmp_path / "m.db"), "c", emb)
    m = MilvusRetriever(str(tmp_path / "m.db"), "c", emb, score_threshold=-1.0, create_if_missing=True)
    chunks = [Chunk("a#0", "a", "Release 4.2.1 fixed error E1234.", "Changelog", {"status": "active"}),
              Chunk("b#0", "b", "Bananas grow in the tropics.", "Fruit", {"status": "old"}),
              Chunk("c#0", "c", "Priya approved release 4.2.1.", "Approval", {"status": "active"})]
    m.upsert(chunks, emb.encode([c.embed_text() for c in chunks]))
    res = m.search_batch(["tropical fruit", "who approved the release"], 2)
    assert res[0][0].doc_id == "b" and res[1][0].doc_id == "c" and res[0][0].source == "milvus"
    only_active = m.search_batch(["tropical fruit"], 3, filters={"status": "active"})[0]
    assert {h.doc_id for h in only_active} == {"a", "c"}
    with pytest.raises(RetrievalError, match="unknown filter field"):
        m.search_batch(["x"], 1, filters={"colour": "red"})
    m.delete_documents(["b"])
    assert "b" not in {h.doc_id for h in m.search_batch(["tropical fruit"], 3)[0]}
    with pytest.raises(RetrievalError, match="dimension mismatch"):
        m.upsert(chunks[:1], np.zeros((1, 8), np.float32))
    assert filter_expression({"valid_until": {"gte": "2026-01-01"}, "kind": {"in": ["a"]}}) == \
        'metadata["valid_until"] >= "2026-01-01" and metadata["kind"] in ["a"]'
    m.close()
