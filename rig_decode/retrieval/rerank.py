"""Reranking in process, within a latency budget.

``RerankingRetriever`` asks its base retriever for ``candidates`` hits per query and reorders them
with a reranker, keeping ``top_n``; the queries of one call are scored together, in one batch. Each
query has a budget in milliseconds: the reranker's cost is predicted from what it has measured so
far (milliseconds per passage); queries are admitted while the batch they wait for is predicted to
stay within the budget, and the others keep the fusion order with the fallback recorded. A reranker
that raises falls back the same way.

Rerankers:

* ``LinkReranker`` (the default, ``type: auto`` or ``links``): listwise, no model. The best hit
  stays first; the candidates whose title its text names come next (two at most), then the rest,
  each group in fusion order. A question's first document names the entity its answer is about (the bridge of a
  multi-hop question), whose own document the question itself rarely names: on HotpotQA and MuSiQue
  questions that lifts recall@2 by 0.07-0.10 and recall@5 by 0.04-0.12 (docs/benchmarks.md,
  "Retrieval"). Candidates without a title, or whose title the best hit does not name, keep their
  order.
* ``CrossEncoderReranker``: a cross-encoder exported to ONNX, run with onnxruntime
  (``scripts/train_reranker.py`` fine-tunes one from the embedded MiniLM and writes this layout).
* ``FlashRankReranker``: a model in flashrank's layout. Nothing is downloaded: flashrank fetches a
  model only when its directory is missing, and we refuse before that happens. Good models:
  ``ms-marco-TinyBERT-L-2-v2`` (~4 MB, fastest), ``ms-marco-MiniLM-L-12-v2`` (~34 MB, better),
  ``ms-marco-MultiBERT-L-12`` (multilingual, for Chinese corpora). Put the unzipped folder under
  ``reranker.model_dir``.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Protocol

from .base import Hit, HitList, RetrievalError, Retriever


def passage_text(title: str | None, text: str) -> str:
    """A passage as a cross-encoder scores it: its title, then its text."""
    return f"{title}: {text}" if title else text


class Reranker(Protocol):
    def rerank(self, query: str, hits: list[Hit], top_n: int) -> list[Hit]: ...


def _reordered(hits: list[Hit], scores, top_n: int) -> list[Hit]:
    """``hits`` by descending score (ties keep their order), the first ``top_n``, each carrying its
    reranker score and its fusion score."""
    order = sorted(range(len(hits)), key=lambda i: -float(scores[i]))[:top_n]
    out = []
    for i in order:
        h = hits[i]
        meta = dict(h.metadata, fusion_score=round(h.score, 4))
        out.append(Hit(h.doc_id, h.text, float(scores[i]), h.title, meta, h.source))
    return out


class LinkReranker:
    """The best hit, then the candidates whose title it names (as a whole word, any case, without a
    trailing disambiguation such as "(film)"), at most ``MAX_LINKED`` of them, then the rest; each
    group in fusion order."""

    name = "links"
    MIN_TITLE_CHARS = 3  # shorter titles name too much by chance
    MAX_LINKED = 2  # a hit that names many titles (an index page) must not push every other candidate out

    def rerank(self, query: str, hits: list[Hit], top_n: int) -> list[Hit]:
        if len(hits) < 3:
            return hits[:top_n]
        lead = hits[0]
        named = [i for i, h in enumerate(hits[1:], 1) if h.doc_id != lead.doc_id and _names(lead.text, h.title)]
        named = named[: self.MAX_LINKED]
        linked = [Hit(h.doc_id, h.text, h.score, h.title, dict(h.metadata, linked_from=lead.doc_id), h.source)
                  for h in (hits[i] for i in named)]
        rest = [h for i, h in enumerate(hits[1:], 1) if i not in named]
        return [lead, *linked, *rest][:top_n]


def _names(text: str, title: str | None) -> bool:
    """Whether ``text`` names ``title`` (without a trailing parenthesis) as a whole word, any case."""
    name = re.sub(r"\s*\([^)]*\)$", "", title or "").strip()
    if len(name) < LinkReranker.MIN_TITLE_CHARS:
        return False
    return re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text, re.IGNORECASE) is not None


class CrossEncoderReranker:
    """A cross-encoder in ONNX scored with onnxruntime, many queries' passages in one batch.

    ``model_dir`` holds ``model.onnx`` (inputs ``input_ids``, ``attention_mask``,
    ``token_type_ids``; one logit per pair), ``tokenizer.json`` and ``reranker.json``
    (``max_length``: query and passage together, the passage cut to fit)."""

    def __init__(self, model_dir: str | Path, threads: int | None = None, batch_pairs: int = 32):
        folder = Path(model_dir)
        missing = [f for f in ("model.onnx", "tokenizer.json", "reranker.json") if not (folder / f).is_file()]
        if missing:
            raise RetrievalError(f"reranker model not found: {folder} lacks {', '.join(missing)}")
        try:
            import onnxruntime as ort
        except ImportError:
            raise RetrievalError("the cross-encoder reranker needs onnxruntime (pip install 'rig_decode[rerank]')") from None
        from tokenizers import Tokenizer

        meta = json.loads((folder / "reranker.json").read_text(encoding="utf-8"))
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.enable_truncation(int(meta["max_length"]), strategy="only_second")
        self.tokenizer.enable_padding(pad_id=self.tokenizer.token_to_id("[PAD]") or 0)
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(folder / "model.onnx"), opts, providers=["CPUExecutionProvider"])
        self.inputs = {i.name for i in self.session.get_inputs()}
        self.batch_pairs = batch_pairs
        self.name = folder.name

    def score(self, pairs: list[tuple[str, str]]):
        """One logit per (query, passage) pair, higher is more relevant."""
        import numpy as np

        out = []
        for start in range(0, len(pairs), self.batch_pairs):
            enc = self.tokenizer.encode_batch(pairs[start : start + self.batch_pairs])
            feed = {"input_ids": [e.ids for e in enc], "attention_mask": [e.attention_mask for e in enc],
                    "token_type_ids": [e.type_ids for e in enc]}
            feed = {k: np.asarray(v, dtype=np.int64) for k, v in feed.items() if k in self.inputs}
            out.append(self.session.run(None, feed)[0].reshape(-1))
        return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)

    def rerank_batch(self, queries: list[str], hits: list[list[Hit]], top_n: int) -> list[list[Hit]]:
        pairs = [(q, passage_text(h.title, h.text)) for q, hs in zip(queries, hits) for h in hs]
        scores, out, at = self.score(pairs), [], 0
        for hs in hits:
            out.append(_reordered(hs, scores[at : at + len(hs)], top_n))
            at += len(hs)
        return out

    def rerank(self, query: str, hits: list[Hit], top_n: int) -> list[Hit]:
        return self.rerank_batch([query], [hits], top_n)[0]


class FlashRankReranker:
    def __init__(self, model: str, model_dir: str | Path, max_length: int = 256):
        try:
            from flashrank import Ranker
            from flashrank.Config import model_file_map
        except ImportError:
            raise RetrievalError("reranker type 'flashrank' needs flashrank (pip install 'rig_decode[rerank]')") from None
        if model not in model_file_map:
            raise RetrievalError(f"unknown flashrank model {model!r} (known: {', '.join(model_file_map)})")
        folder = Path(model_dir) / model
        needed = [model_file_map[model], "tokenizer.json", "tokenizer_config.json", "config.json",
                  "special_tokens_map.json"]
        missing = [f for f in needed if not (folder / f).is_file()]
        if missing:
            raise RetrievalError(f"reranker model not found: {folder} lacks {', '.join(missing)} "
                                 "(rig_decode never downloads models; unzip flashrank's model folder there)")
        self.ranker = Ranker(model_name=model, cache_dir=str(model_dir), max_length=max_length, log_level="WARNING")
        self.name = model

    def rerank(self, query: str, hits: list[Hit], top_n: int) -> list[Hit]:
        from flashrank import RerankRequest

        if not hits:
            return []
        passages = [{"id": i, "text": passage_text(h.title, h.text)} for i, h in enumerate(hits)]
        scores = [0.0] * len(hits)
        for p in self.ranker.rerank(RerankRequest(query=query, passages=passages)):
            scores[p["id"]] = float(p["score"])
        return _reordered(hits, scores, top_n)


class RerankingRetriever:
    def __init__(self, base: Retriever, reranker: Reranker, top_n: int | None = None, candidates: int = 10,
                 budget_ms: float = 200.0):
        self.base, self.reranker = base, reranker
        self.top_n, self.candidates, self.budget_ms = top_n, candidates, budget_ms
        self.ms_per_passage: float | None = None  # running estimate, updated after each call

    @property
    def docs(self):
        return getattr(self.base, "docs", [])

    def knows(self, term: str) -> bool | None:
        knows = getattr(self.base, "knows", None)
        return None if knows is None else knows(term)

    def search_batch(self, queries: list[str], top_k: int, filters: dict[str, Any] | None = None) -> list[HitList]:
        results = self.base.search_batch(queries, max(top_k, self.candidates), filters)
        keep = top_k if self.top_n is None else min(top_k, self.top_n)
        out = [HitList(list(hits)[:keep], dict(getattr(hits, "info", {}))) for hits in results]
        admitted, passages = [], 0  # queries scored together: each waits for the whole batch
        for i, hits in enumerate(results):
            predicted = None if self.ms_per_passage is None else self.ms_per_passage * (passages + len(hits))
            if predicted is not None and predicted > self.budget_ms:
                out[i].info["rerank"] = f"skipped: predicted {predicted:.0f} ms > budget {self.budget_ms:g} ms"
                out[i].info["fallback"] = "fusion order (rerank over budget)"
            elif hits:
                admitted.append(i)
                passages += len(hits)
        if not admitted:
            return out
        t0 = time.perf_counter()
        try:
            batch = getattr(self.reranker, "rerank_batch", None)
            if batch is not None:
                ranked = batch([queries[i] for i in admitted], [list(results[i]) for i in admitted], keep)
            else:
                ranked = [self.reranker.rerank(queries[i], list(results[i]), keep) for i in admitted]
        except Exception as e:  # noqa: BLE001 - a failing reranker falls back to fusion order
            for i in admitted:
                out[i].info["rerank"] = f"failed: {type(e).__name__}: {e}"
                out[i].info["fallback"] = "fusion order (rerank failed)"
            return out
        ms = (time.perf_counter() - t0) * 1e3
        per = ms / passages
        self.ms_per_passage = per if self.ms_per_passage is None else 0.7 * self.ms_per_passage + 0.3 * per
        for i, hits in zip(admitted, ranked):
            info = out[i].info
            info["rerank"] = f"{len(results[i])} -> {len(hits)} in {ms:.0f} ms"
            if len(admitted) > 1:
                info["rerank"] += f" (a batch of {len(admitted)} queries)"
            if ms > self.budget_ms:
                info["rerank"] += f" (over the {self.budget_ms:g} ms budget)"
            out[i] = HitList(hits, info)
        return out
