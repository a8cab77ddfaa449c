"""The same retrieval protocol on Milvus, for corpora that outgrow one machine.

``uri`` is a local file for embedded Milvus Lite (``rig_milvus.db``) or a server/cluster URI
(``http://host:19530``, with ``token`` for auth); nothing else changes. A collection holds one row
per chunk: id, doc_id, title, text, metadata (JSON) and the normalised embedding, searched by inner
product. Metadata filters use the same syntax as the local store and become Milvus expressions on
the JSON field.
"""

from __future__ import annotations

import datetime as _dt
import json
from typing import Any

import numpy as np

from .base import Hit, HitList, RetrievalError
from .dense import Embedder
from .store import Chunk

_OPS = {"eq": "==", "ne": "!=", "gt": ">", "gte": ">=", "lt": "<", "lte": "<=", "in": "in", "nin": "not in"}


def filter_expression(filters: dict[str, Any] | None, known_fields: set[str] | None = None) -> str:
    if not filters:
        return ""
    parts = []
    for field, cond in filters.items():
        if known_fields is not None and field not in known_fields:
            raise RetrievalError(f"unknown filter field {field!r} (documents have: {', '.join(sorted(known_fields)) or 'none'})")
        for op, value in (cond if isinstance(cond, dict) else {"eq": cond}).items():
            if op not in _OPS:
                raise RetrievalError(f"unknown filter operator {op!r} for field {field!r}")
            if value == "today":
                value = _dt.date.today().isoformat()
            parts.append(f'metadata[{json.dumps(field)}] {_OPS[op]} {json.dumps(value)}')
    return " and ".join(parts)


class MilvusRetriever:
    def __init__(self, uri: str, collection: str, embedder: Embedder, token: str | None = None,
                 score_threshold: float = 0.0, create_if_missing: bool = False):
        try:
            from pymilvus import MilvusClient
        except ImportError:
            raise RetrievalError("retriever type 'milvus' needs pymilvus (pip install 'rig_decode[milvus]')") from None
        try:
            self.client = MilvusClient(uri=uri, **({"token": token} if token else {}))
        except Exception as e:  # noqa: BLE001 - connection errors come in many types
            raise RetrievalError(f"cannot connect to Milvus at {uri}: {e}") from e
        self.uri, self.collection, self.embedder = uri, collection, embedder
        self.score_threshold = score_threshold
        if not self.client.has_collection(collection):
            if not create_if_missing:
                raise RetrievalError(f"Milvus collection {collection!r} not found at {uri} "
                                     "(load one with `rig index build --milvus-uri ...`)")
            self._create()
        self.fields = self._metadata_fields()

    def _create(self) -> None:
        from pymilvus import DataType

        schema = self.client.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("id", DataType.VARCHAR, is_primary=True, max_length=1024)
        schema.add_field("doc_id", DataType.VARCHAR, max_length=1024)
        schema.add_field("title", DataType.VARCHAR, max_length=2048)
        schema.add_field("text", DataType.VARCHAR, max_length=65535)
        schema.add_field("metadata", DataType.JSON)
        schema.add_field("vector", DataType.FLOAT_VECTOR, dim=self.embedder.dim)
        index = self.client.prepare_index_params()
        index.add_index(field_name="vector", index_type="AUTOINDEX", metric_type="IP")
        self.client.create_collection(self.collection, schema=schema, index_params=index)

    def _metadata_fields(self, sample: int = 1000) -> set[str]:
        rows = self.client.query(self.collection, filter='id != ""', output_fields=["metadata"], limit=sample)
        return {k for r in rows for k in (r.get("metadata") or {})}

    def upsert(self, chunks: list[Chunk], embeddings: np.ndarray, batch: int = 512) -> None:
        """Insert chunks; every existing chunk of the same documents is replaced."""
        if embeddings.shape[1] != self.embedder.dim:
            raise RetrievalError(f"embedding-dimension mismatch: {embeddings.shape[1]}-d vectors for a "
                                 f"{self.embedder.dim}-d collection")
        self.delete_documents(sorted({c.doc_id for c in chunks}))
        rows = [{"id": c.id, "doc_id": c.doc_id, "title": c.title or "", "text": c.text, "metadata": c.metadata,
                 "vector": v.tolist()} for c, v in zip(chunks, embeddings)]
        for i in range(0, len(rows), batch):
            self.client.insert(self.collection, rows[i : i + batch])
        self.fields |= {k for c in chunks for k in c.metadata}

    def delete_documents(self, doc_ids: list[str]) -> None:
        if doc_ids:
            self.client.delete(self.collection, filter=f"doc_id in {json.dumps(doc_ids)}")

    @property
    def docs(self) -> list:
        return []

    def search_batch(self, queries: list[str], top_k: int, filters: dict[str, Any] | None = None) -> list[HitList]:
        if not queries:
            return []
        vecs = self.embedder.encode_queries(queries)
        res = self.client.search(self.collection, data=vecs.tolist(), limit=top_k, filter=filter_expression(filters, self.fields),
                                 output_fields=["doc_id", "title", "text", "metadata"])
        out = []
        for row in res:
            hits = [Hit(h["entity"]["doc_id"], h["entity"]["text"], float(h["distance"]), h["entity"]["title"] or None,
                        dict(h["entity"]["metadata"] or {}, chunk_id=h["id"]), "milvus")
                    for h in row if h["distance"] >= self.score_threshold]
            out.append(HitList(hits, {"mode": "milvus"}))
        return out

    def close(self) -> None:
        self.client.close()
