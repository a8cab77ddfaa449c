"""LangChain and LlamaIndex retrievers as rig retrievers (``search_batch``), for a store a team
already has: wrap it in a ``retriever.type: python`` factory, or pass it to ``RigSession`` /
``rig_decode.hf.generate`` directly.

* ``LangChainRetriever(vector_store=...)``: a LangChain ``VectorStore``, searched with
  ``similarity_search_with_score`` (``k=top_k``, rig's ``filters`` as its ``filter``), the queries
  of one engine step in parallel; or ``LangChainRetriever(retriever=...)``: any LangChain retriever
  (a ``Runnable``), the step's queries through one ``batch`` call, its documents in rank order.
* ``LlamaIndexRetriever(retriever)``: a LlamaIndex retriever (``index.as_retriever()``), the step's
  queries through ``aretrieve`` concurrently.

Each document becomes a ``Hit``: its id (the framework's, else ``metadata["id"]``, else a hash of
its text), ``metadata["title"]`` as title, the framework's score (for a plain LangChain retriever,
which reports none: ``1 / rank``) and its metadata. Neither framework is a dependency of
rig_decode: install the one you use (``pip install langchain-core`` / ``llama-index-core``).
``RigEmbeddings`` gives LangChain rig's embedder (the embedded all-MiniLM-L6-v2 by default).
"""

from __future__ import annotations

import asyncio
import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .base import Hit, RetrievalError


def _hit(doc_id, text: str, score: float | None, metadata: dict | None, rank: int, source: str) -> Hit:
    metadata = dict(metadata or {})
    doc_id = doc_id or metadata.get("id") or "sha1:" + hashlib.sha1(text.encode()).hexdigest()[:16]
    title = metadata.get("title")
    return Hit(str(doc_id), text, float(score) if score is not None else 1.0 / (rank + 1),
               title=str(title) if title is not None else None, metadata=metadata, source=source)


class LangChainRetriever:
    def __init__(self, vector_store=None, *, retriever=None, max_workers: int = 8):
        if (vector_store is None) == (retriever is None):
            raise ValueError("LangChainRetriever takes a vector_store or a retriever (one of them)")
        if vector_store is not None and not hasattr(vector_store, "similarity_search_with_score"):
            raise RetrievalError(f"{type(vector_store).__name__} has no similarity_search_with_score: not a "
                                 "LangChain vector store")
        if retriever is not None and not hasattr(retriever, "batch"):
            raise RetrievalError(f"{type(retriever).__name__} has no batch(): not a LangChain retriever")
        self.store, self.retriever = vector_store, retriever
        self.pool = ThreadPoolExecutor(max_workers, thread_name_prefix="rig-langchain")

    def search_batch(self, queries: list[str], top_k: int, filters: dict[str, Any] | None = None) -> list[list[Hit]]:
        if self.store is not None:
            def one(q):
                kwargs = {"filter": filters} if filters else {}
                return [_hit(getattr(d, "id", None), d.page_content, s, d.metadata, r, "langchain")
                        for r, (d, s) in enumerate(self.store.similarity_search_with_score(q, k=top_k, **kwargs))]

            return list(self.pool.map(one, queries))
        if filters:
            raise RetrievalError("a LangChain retriever takes its filters where it is built, not per search")
        return [[_hit(getattr(d, "id", None), d.page_content, None, d.metadata, r, "langchain")
                 for r, d in enumerate(docs[:top_k])] for docs in self.retriever.batch(list(queries))]

    def close(self) -> None:
        self.pool.shutdown(wait=False)


class LlamaIndexRetriever:
    def __init__(self, retriever):
        if not hasattr(retriever, "aretrieve"):
            raise RetrievalError(f"{type(retriever).__name__} has no aretrieve(): not a LlamaIndex retriever")
        self.retriever = retriever

    def search_batch(self, queries: list[str], top_k: int, filters: dict[str, Any] | None = None) -> list[list[Hit]]:
        if filters:
            raise RetrievalError("a LlamaIndex retriever takes its filters where it is built, not per search")

        async def every():
            return await asyncio.gather(*(self.retriever.aretrieve(q) for q in queries))

        # the retrieval worker's thread has no running loop: one of its own per call
        return [[_hit(n.node.node_id, n.node.get_content(), n.score, n.node.metadata, r, "llamaindex")
                 for r, n in enumerate(nodes[:top_k])] for nodes in asyncio.run(every())]


def RigEmbeddings(model: str = "all-minilm-l6-v2"):  # noqa: N802 - a class, built where langchain-core imports
    """LangChain ``Embeddings`` over rig's embedder (``retrieval.dense.Embedder``): the embedded
    all-MiniLM-L6-v2, offline, by default."""
    from langchain_core.embeddings import Embeddings

    from .dense import Embedder

    class _RigEmbeddings(Embeddings):
        def __init__(self):
            self.embedder = Embedder(model)

        def embed_documents(self, texts: list[str]) -> list[list[float]]:
            return self.embedder.encode(list(texts)).tolist()

        def embed_query(self, text: str) -> list[float]:
            return self.embedder.encode([text])[0].tolist()

    return _RigEmbeddings()
