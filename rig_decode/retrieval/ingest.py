"""Ingestion: read documents, chunk them, embed the chunks, and write an index store.

Sources: a folder of Markdown/text files (optional YAML front matter between ``---`` lines gives
``id``, ``title`` and any metadata fields) and JSONL files (``id``, ``text``, optional ``title`` and
``metadata``). Chunking follows the text: Chinese/Japanese/Korean text is cut by characters
(default 400, within the usual 300-500), other text by words (default 200, within 150-250), with
an overlap (default 15%) so a fact on a boundary is whole in at least one chunk.

Updates are incremental by document id: a build over an existing index adds new documents,
replaces changed ones and keeps the rest; chunks whose text did not change keep their embeddings
(looked up by content hash), so only new text reaches the embedding model. Every write is atomic.
"""

from __future__ import annotations

import json
import re
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import yaml
from tqdm.auto import tqdm

from .base import Document, RetrievalError
from .dense import Embedder
from .store import Chunk, IndexStore
from .text import has_cjk

TEXT_SUFFIXES = {".md", ".markdown", ".txt"}
_FRONT = re.compile(r"\A---\s*\n(.*?)\n---\s*\n", re.DOTALL)
_HEADING = re.compile(r"^#\s+(.+)$", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Chunking:
    words: int = 200
    chars: int = 400
    overlap: float = 0.15

    def __post_init__(self):
        if self.words < 10 or self.chars < 20:
            raise RetrievalError("chunks must be at least 10 words / 20 characters")
        if not 0 <= self.overlap < 0.5:
            raise RetrievalError(f"chunk overlap {self.overlap} must be in [0, 0.5)")


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
            meta = rec.get("metadata") or {}
            if not isinstance(meta, dict):
                raise RetrievalError(f"{path}:{n}: field 'metadata' must be an object")
            seen.add(rec["id"])
            docs.append(Document(rec["id"], rec["text"], rec.get("title"), meta))
    if not docs:
        raise RetrievalError(f"{path}: no documents")
    return docs


def read_text_document(path: Path, root: Path) -> Document | None:
    raw = path.read_text(encoding="utf-8", errors="replace")
    meta: dict = {}
    m = _FRONT.match(raw)
    if m:
        try:
            meta = yaml.safe_load(m.group(1)) or {}
        except yaml.YAMLError as e:
            raise RetrievalError(f"{path}: invalid front matter ({e})") from None
        if not isinstance(meta, dict):
            raise RetrievalError(f"{path}: front matter must be a mapping")
        raw = raw[m.end():]
    if not raw.strip():
        return None
    doc_id = str(meta.pop("id", path.relative_to(root).with_suffix("").as_posix()))
    heading = _HEADING.search(raw)
    title = meta.pop("title", None) or (heading.group(1).strip() if heading else path.stem)
    meta = {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in meta.items()}  # YAML dates
    return Document(doc_id, raw.strip(), str(title), meta)


def read_folder(folder: str | Path) -> list[Document]:
    root = Path(folder)
    if not root.exists():
        raise RetrievalError(f"input not found: {root}")
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    docs: list[Document] = []
    for p in tqdm(files, desc="reading", unit="file", disable=len(files) < 200, file=sys.stderr):
        if p.suffix == ".jsonl":
            docs += load_documents(p)
        elif p.suffix in TEXT_SUFFIXES:
            d = read_text_document(p, root if root.is_dir() else root.parent)
            if d is not None:
                docs.append(d)
    seen: dict[str, int] = {}
    for d in docs:
        seen[d.doc_id] = seen.get(d.doc_id, 0) + 1
    dup = [k for k, v in seen.items() if v > 1]
    if dup:
        raise RetrievalError(f"duplicate document ids in {root}: {', '.join(dup[:5])}")
    return docs


def chunk_document(doc: Document, cfg: Chunking = Chunking()) -> list[Chunk]:
    text = " ".join(doc.text.split())
    cjk = has_cjk(text) and sum(map(_is_cjk, text)) > len(text) / 3
    units: list[str] = list(text) if cjk else text.split(" ")
    size = cfg.chars if cjk else cfg.words
    step = max(1, int(size * (1 - cfg.overlap)))
    pieces, start = [], 0
    while True:
        piece = units[start : start + size]
        pieces.append(("" if cjk else " ").join(piece))
        if start + size >= len(units):
            break
        start += step
    return [Chunk(f"{doc.doc_id}#{i}", doc.doc_id, p, doc.title, dict(doc.metadata)) for i, p in enumerate(pieces)]


def _is_cjk(ch: str) -> bool:
    return has_cjk(ch)


def build_index(docs: Iterable[Document], embedder: Embedder, out: str | Path, chunking: Chunking = Chunking(),
                namespace: str | None = None, replace: bool = False, delete: Iterable[str] = (),
                progress: bool = True) -> dict:
    """Create or update the index at ``out``; returns what changed and what it cost."""
    t0 = time.perf_counter()
    out = Path(out)
    docs = list(docs)
    if not docs and not delete:
        raise RetrievalError("nothing to index: the input holds no documents")
    old = IndexStore.load(out) if out.exists() and not replace else None
    if old is not None and old.manifest.get("embedding_model") != embedder.name:
        raise RetrievalError(f"index {out} was built with {old.manifest.get('embedding_model')!r}, not "
                             f"{embedder.name!r}: rebuild it with --replace")
    new_chunks = [c for d in docs for c in chunk_document(d, chunking)]
    if namespace:
        for c in new_chunks:
            c.metadata["namespace"] = namespace
    drop = {d.doc_id for d in docs} | set(delete)
    kept = [] if old is None else [c for c in old.chunks if c.doc_id not in drop]
    cache: dict[str, np.ndarray] = {}
    if old is not None:
        cache = {c.hash: old.embeddings[i] for i, c in enumerate(old.chunks)}
    todo = [c for c in new_chunks if c.hash not in cache]
    if todo:
        vecs = embedder.encode([c.embed_text() for c in todo], progress=progress)
        cache.update({c.hash: v for c, v in zip(todo, vecs)})
    chunks = kept + new_chunks
    if not chunks:
        raise RetrievalError("the index would be empty")
    if old is not None:
        kept_emb = old.embeddings[[i for i, c in enumerate(old.chunks) if c.doc_id not in drop]]
    else:
        kept_emb = np.zeros((0, embedder.dim), dtype=np.float32)
    new_emb = np.stack([cache[c.hash] for c in new_chunks]) if new_chunks else np.zeros((0, embedder.dim), np.float32)
    manifest = {"embedding_model": embedder.name, "chunking": {"words": chunking.words, "chars": chunking.chars,
                                                                "overlap": chunking.overlap}}
    store = IndexStore(chunks, np.concatenate([kept_emb, new_emb]).astype(np.float32), manifest)
    store.save(out)
    docs_before = 0 if old is None else len({c.doc_id for c in old.chunks})
    return {"documents": len({c.doc_id for c in chunks}), "chunks": len(chunks), "documents_before": docs_before,
            "upserted_documents": len(docs), "deleted_documents": len(set(delete)), "embedded_chunks": len(todo),
            "reused_embeddings": len(new_chunks) - len(todo), "seconds": round(time.perf_counter() - t0, 2),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
