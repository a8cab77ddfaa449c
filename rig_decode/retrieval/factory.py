"""Build the retriever a ``retriever:`` config section describes."""

from __future__ import annotations

import hashlib
import json
import sys
from importlib import resources
from pathlib import Path

from ..config import RetrieverConfig
from .base import Document, RetrievalError
from .dense import DenseRetriever, Embedder, load_documents


def demo_corpus_path() -> Path:
    return Path(str(resources.files("rig_decode") / "data" / "demo_kb.jsonl"))


def build_retriever(cfg: RetrieverConfig, cache_dir: Path | None = None,
                    corpus: list[Document] | None = None) -> DenseRetriever:
    """``corpus`` (e.g. an eval dataset's documents) overrides ``index_path`` and the demo corpus."""
    embedder = Embedder(cfg.embedding_model)
    if corpus is not None:
        return cached_retriever(corpus, embedder, cfg.score_threshold, "corpus", cache_dir)
    if cfg.index_path:
        return DenseRetriever.load(cfg.index_path, embedder, cfg.score_threshold)
    return cached_retriever(load_documents(demo_corpus_path()), embedder, cfg.score_threshold, "demo", cache_dir)


def cached_retriever(docs: list[Document], embedder: Embedder, score_threshold: float, name: str,
                     cache_dir: Path | None = None) -> DenseRetriever:
    """An index over ``docs``, built once per (documents, embedder) and kept in the cache."""
    from ..models.embedded import cache_dir as default_cache

    h = hashlib.sha1(embedder.name.encode())
    for d in docs:
        h.update(json.dumps([d.doc_id, d.title, d.text], ensure_ascii=False).encode())
    path = (cache_dir or default_cache()) / "indexes" / f"{name}-{h.hexdigest()[:12]}"
    if path.is_dir():
        try:
            return DenseRetriever.load(path, embedder, score_threshold)
        except RetrievalError as e:
            print(f"[rig] rebuilding the cached index: {e}", file=sys.stderr)
    print(f"[rig] indexing {len(docs)} documents", file=sys.stderr)
    retriever = DenseRetriever.build(docs, embedder, score_threshold)
    retriever.save(path)
    return retriever
