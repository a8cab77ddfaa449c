"""Build the retriever a ``retriever:`` config section describes."""

from __future__ import annotations

import hashlib
import sys
from importlib import resources
from pathlib import Path

from ..config import RetrieverConfig
from .base import Document, RetrievalError, Retriever
from .dense import Embedder
from .index_retriever import IndexRetriever
from .ingest import Chunking, build_index, load_documents
from .store import IndexStore

MODES = {"faiss": "dense", "bm25": "lexical", "hybrid": "hybrid"}


def demo_corpus_path() -> Path:
    return Path(str(resources.files("rig_decode") / "data" / "demo_kb.jsonl"))


def build_retriever(cfg: RetrieverConfig, cache_dir: Path | None = None,
                    corpus: list[Document] | None = None) -> Retriever:
    """``corpus`` (an eval dataset's documents, one chunk each) overrides ``index_path``; with
    neither, the bundled demo knowledge base is used."""
    from ..models.embedded import cache_dir as default_cache

    cache = cache_dir or default_cache()
    if cfg.type == "python":
        return _rerank(from_factory(cfg.factory, cfg.factory_args), cfg, cache)
    if cfg.type == "milvus":
        from .milvus import MilvusRetriever

        return _rerank(MilvusRetriever(cfg.milvus.uri, cfg.milvus.collection, Embedder(cfg.embedding_model),
                                       token=cfg.milvus.token, score_threshold=cfg.score_threshold), cfg, cache)
    embedder = Embedder(cfg.embedding_model, cache_size=cfg.query_cache_size)
    if corpus is not None:
        store = cached_store(corpus, embedder, "corpus", cache, chunking=None)
    elif cfg.index_path:
        store = IndexStore.load(cfg.index_path)
    else:
        store = cached_store(load_documents(demo_corpus_path()), embedder, "demo", cache, chunking=None)
    filters = dict(cfg.filters)
    if cfg.namespace:
        filters["namespace"] = cfg.namespace
    retriever = IndexRetriever(
        store, embedder, MODES[cfg.type], alpha=cfg.alpha, fusion=cfg.fusion, candidates=cfg.candidates,
        router=cfg.router, router_alpha=cfg.router_alpha, score_threshold=cfg.score_threshold,
        default_filters=filters, index_type=cfg.index_type, ann_threshold=cfg.ann_threshold,
        timeout_s=cfg.timeout_s, typo_similarity=cfg.typo_similarity,
    )
    return _rerank(retriever, cfg, cache)


def from_factory(factory: str, kwargs: dict) -> Retriever:
    """``retriever.type: python``: ``package.module:callable(**kwargs)``, which must return an object
    with ``search_batch(queries, top_k, filters=None)``. Its hits pass the retrieval worker's checks
    like any retriever's. RetrievalError, naming the factory, for anything that keeps it from starting."""
    import importlib

    module_name, _, attr = factory.partition(":")
    try:
        target = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as e:
        raise RetrievalError(f"retriever.factory {factory!r} cannot be imported: {e}") from None
    if not callable(target):
        raise RetrievalError(f"retriever.factory {factory!r} is not callable")
    try:
        retriever = target(**kwargs)
    except Exception as e:  # noqa: BLE001 - the user's code: say whose it is
        raise RetrievalError(f"retriever.factory {factory!r} failed: {type(e).__name__}: {e}") from e
    if not callable(getattr(retriever, "search_batch", None)):
        raise RetrievalError(f"retriever.factory {factory!r} returned a {type(retriever).__name__}, which has no "
                             "search_batch(queries, top_k, filters=None): not a retriever")
    return retriever


def _rerank(retriever: Retriever, cfg: RetrieverConfig, cache: Path) -> Retriever:
    rc = cfg.reranker
    if rc.type == "none":
        return retriever
    from .rerank import CrossEncoderReranker, FlashRankReranker, LinkReranker, RerankingRetriever

    if rc.type in ("auto", "links"):
        reranker = LinkReranker()
    elif rc.type == "flashrank":
        reranker = FlashRankReranker(rc.model, rc.model_dir or cache / "rerankers")
    else:
        reranker = CrossEncoderReranker(rc.model_dir)
    return RerankingRetriever(retriever, reranker, rc.top_n, rc.candidates, rc.budget_ms)


def cached_store(docs: list[Document], embedder: Embedder, name: str, cache: Path,
                 chunking: Chunking | None = Chunking()) -> IndexStore:
    """An index over ``docs``, built once per (documents, embedder, chunking) and kept in the cache.
    ``chunking=None`` keeps one chunk per document (corpora that are passage-sized already)."""
    h = hashlib.sha1(f"{embedder.name}|{chunking}".encode())
    for d in docs:
        h.update(f"{d.doc_id}\x00{d.title}\x00{d.text}\x00{sorted(d.metadata.items())}\x01".encode())
    path = cache / "indexes" / f"{name}-{h.hexdigest()[:12]}"
    if path.is_dir():
        try:
            return IndexStore.load(path)
        except RetrievalError as e:
            print(f"[rig] rebuilding the cached index: {e}", file=sys.stderr)
    print(f"[rig] indexing {len(docs)} documents", file=sys.stderr)
    build_index(docs, embedder, path, chunking or Chunking(words=10**6, chars=10**6), replace=True,
                progress=len(docs) > 500)
    return IndexStore.load(path)
