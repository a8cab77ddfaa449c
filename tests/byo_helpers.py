"""Retrievers as a user's own code would define them, for ``retriever.type: python``."""

from __future__ import annotations

import json
import math
import re

from rig_decode.retrieval.base import Hit


class KeywordStore:
    """A store of the user's own: documents from a JSONL file, ranked by the rarity-weighted words
    they share with the query (no rig index involved)."""

    def __init__(self, path: str, min_overlap: int = 1):
        with open(path, encoding="utf-8") as f:
            self.docs = [json.loads(line) for line in f if line.strip()]
        self.words = [self._words(d["title"] + " " + d["text"]) for d in self.docs]
        counts: dict[str, int] = {}
        for ws in self.words:
            for w in ws:
                counts[w] = counts.get(w, 0) + 1
        self.idf = {w: math.log(len(self.docs) / n) for w, n in counts.items()}
        self.min_overlap = min_overlap
        self.calls = 0

    @staticmethod
    def _words(text: str) -> set[str]:
        return set(re.findall(r"\w+", text.lower()))

    def search_batch(self, queries, top_k, filters=None):
        self.calls += 1
        out = []
        for q in queries:
            words = self._words(q)
            scored = sorted(((-sum(self.idf[w] for w in words & ws), -len(words & ws), i)
                             for i, ws in enumerate(self.words)))
            out.append([Hit(self.docs[i]["id"], self.docs[i]["text"], -score, title=self.docs[i]["title"],
                            source="user")
                        for score, overlap, i in scored[:top_k] if -overlap >= self.min_overlap])
        return out


def broken(**kwargs):
    raise ConnectionError("the vector store refused the connection")


def not_a_retriever(**kwargs):
    return {"search": "nothing"}


def _demo_docs(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def langchain_store(path: str):
    """A LangChain in-memory vector store over a JSONL corpus, as a rig retriever."""
    from langchain_core.documents import Document
    from langchain_core.vectorstores import InMemoryVectorStore

    from rig_decode.retrieval.frameworks import LangChainRetriever, RigEmbeddings

    store = InMemoryVectorStore(RigEmbeddings())
    store.add_documents([Document(page_content=d["text"], metadata={"title": d["title"], **d.get("metadata", {})},
                                  id=d["id"]) for d in _demo_docs(path)])
    return LangChainRetriever(store)


def llamaindex_store(path: str, k: int = 3):
    """A LlamaIndex in-memory vector index over a JSONL corpus (one node per document, rig's
    embedder as its embed model), as a rig retriever."""
    from llama_index.core import VectorStoreIndex
    from llama_index.core.embeddings import BaseEmbedding
    from llama_index.core.schema import TextNode

    from rig_decode.retrieval.dense import Embedder
    from rig_decode.retrieval.frameworks import LlamaIndexRetriever

    embedder = Embedder("all-minilm-l6-v2")

    class MiniLM(BaseEmbedding):
        def _get_query_embedding(self, query):
            return embedder.encode([query])[0].tolist()

        def _get_text_embedding(self, text):
            return embedder.encode([text])[0].tolist()

        async def _aget_query_embedding(self, query):
            return self._get_query_embedding(query)

    nodes = [TextNode(id_=d["id"], text=d["text"], metadata={"title": d["title"]}) for d in _demo_docs(path)]
    index = VectorStoreIndex(nodes=nodes, embed_model=MiniLM())
    return LlamaIndexRetriever(index.as_retriever(similarity_top_k=k))
