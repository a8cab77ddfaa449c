"""An index on disk: chunks, their embeddings, and a manifest, in one directory.

    manifest.json    version, embedding model and dimension, counts, chunking settings
    chunks.jsonl     one chunk per line: id, doc_id, title, text, metadata, hash
    embeddings.npy   float32 [chunks, dim], L2-normalised, row i = line i of chunks.jsonl

A save writes a complete new directory beside the old one and renames it into place, so a crash
mid-write leaves the previous index intact. Loading checks every file and says what is wrong with
the first one that is missing, corrupt, truncated or inconsistent. Search structures (FAISS, BM25)
are rebuilt from these files at load: they are derived data, and never go stale.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .base import Document, RetrievalError

STORE_VERSION = 2
FILES = ("manifest.json", "chunks.jsonl", "embeddings.npy")


@dataclass(slots=True)
class Chunk:
    id: str
    doc_id: str
    text: str
    title: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    hash: str = ""

    def __post_init__(self):
        if not self.hash:
            self.hash = content_hash(self.title, self.text)

    def embed_text(self) -> str:
        return f"{self.title}: {self.text}" if self.title else self.text


def content_hash(title: str | None, text: str) -> str:
    return hashlib.sha1(f"{title or ''}\x00{text}".encode()).hexdigest()[:16]


def chunks_from_documents(docs: list[Document]) -> list[Chunk]:
    """One chunk per document (for corpora that are already passage-sized)."""
    return [Chunk(d.doc_id, d.doc_id, d.text, d.title, dict(d.metadata)) for d in docs]


@dataclass(slots=True)
class IndexStore:
    chunks: list[Chunk]
    embeddings: np.ndarray
    manifest: dict[str, Any]

    def __post_init__(self):
        if len(self.chunks) != len(self.embeddings):
            raise RetrievalError(f"{len(self.chunks)} chunks but {len(self.embeddings)} embeddings")

    @property
    def dim(self) -> int:
        return int(self.embeddings.shape[1])

    @property
    def metadata_fields(self) -> set[str]:
        return {k for c in self.chunks for k in c.metadata}

    def stats(self) -> dict[str, Any]:
        return {"documents": len({c.doc_id for c in self.chunks}), "chunks": len(self.chunks), "dim": self.dim,
                "embedding_model": self.manifest.get("embedding_model"),
                "metadata_fields": sorted(self.metadata_fields), "chunking": self.manifest.get("chunking")}

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        try:
            manifest = dict(self.manifest, version=STORE_VERSION, chunks=len(self.chunks), dim=self.dim)
            with (tmp / "chunks.jsonl").open("w", encoding="utf-8") as f:
                for c in self.chunks:
                    f.write(json.dumps(asdict(c), ensure_ascii=False) + "\n")
            np.save(tmp / "embeddings.npy", np.ascontiguousarray(self.embeddings, dtype=np.float32))
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False))
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
    def load(cls, path: str | Path) -> "IndexStore":
        path = Path(path)
        if not path.is_dir():
            raise RetrievalError(f"index not found: {path} (build one with `rig index build`)")
        for name in FILES:
            if not (path / name).is_file():
                raise RetrievalError(f"index {path} is incomplete: {name} is missing")
        try:
            manifest = json.loads((path / "manifest.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RetrievalError(f"index {path}: manifest.json is corrupt ({e})") from None
        if manifest.get("version") != STORE_VERSION:
            raise RetrievalError(f"index {path}: format version {manifest.get('version')!r}, "
                                 f"this rig_decode reads {STORE_VERSION}; rebuild it with `rig index build`")
        chunks = []
        with (path / "chunks.jsonl").open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                try:
                    chunks.append(Chunk(**json.loads(line)))
                except (json.JSONDecodeError, TypeError) as e:
                    raise RetrievalError(f"index {path}: chunks.jsonl line {n} is corrupt ({e})") from None
        try:
            emb = np.load(path / "embeddings.npy", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise RetrievalError(f"index {path}: embeddings.npy is corrupt or truncated ({e})") from None
        if emb.ndim != 2 or len(emb) != len(chunks) or manifest.get("chunks") != len(chunks):
            raise RetrievalError(f"index {path}: {len(chunks)} chunks, {manifest.get('chunks')} in the manifest, "
                                 f"embeddings of shape {tuple(emb.shape)}: the files do not belong together")
        if not chunks:
            raise RetrievalError(f"index {path} holds no documents")
        return cls(chunks, emb.astype(np.float32, copy=False), manifest)
