"""Build the retriever a ``retriever:`` config section describes."""

from __future__ import annotations

import hashlib
import sys
from importlib import resources
from pathlib import Path

from ..config import RetrieverConfig
from .base import RetrievalError
from .dense import DenseRetriever, Embedder, load_documents


def demo_corpus_path() -> Path:
    return Path(str(resources.files("rig_decode") / "data" / "demo_kb.jsonl"))


def build_retriever(cfg: RetrieverConfig, cache_dir: Path | None = None) -> DenseRetriever:
    embedder = Embedder(cfg.embedding_model)
    if cfg.index_path:
        return DenseRetriever.load(cfg.index_path, embedder, cfg.score_threshold)
    return demo_retriever(embedder, cfg.score_threshold, cache_dir)


def demo_retriever(embedder: Embedder, score_threshold: float, cache_dir: Path | None = None) -> DenseRetriever:
    """The bundled demo knowledge base, indexed once per (corpus, embedder) into the cache."""
    from ..models.embedded import cache_dir as default_cache

    corpus = demo_corpus_path()
    key = hashlib.sha1(corpus.read_bytes() + embedder.name.encode()).hexdigest()[:12]
    path = (cache_dir or default_cache()) / "indexes" / f"demo-{key}"
    if path.is_dir():
        try:
            return DenseRetriever.load(path, embedder, score_threshold)
        except RetrievalError as e:
            print(f"[rig] rebuilding the demo index: {e}", file=sys.stderr)
    retriever = DenseRetriever.build(load_documents(corpus), embedder, score_threshold)
    retriever.save(path)
    return retriever
