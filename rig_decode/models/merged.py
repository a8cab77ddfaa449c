"""A model with its marker adapter merged in, saved once as a checkpoint an outside engine loads.

vLLM loads weights from a model directory and knows nothing of ``model.adapter``. ``merged_checkpoint``
merges the adapter the way ``load_model`` does in process (the tokenizer's marker tokens added, the
embeddings resized, the LoRA weights folded in) and saves the result with its tokenizer under
``<cache>/merged/<model>-<key>``, where the key hashes the model, the adapter's files and the dtype:
a retrained adapter gets a new directory, an unchanged one is merged once. The directory is written
under a temporary name and renamed, so an interrupted merge leaves nothing half-written behind.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
from pathlib import Path

from ..config import ModelConfig
from .embedded import cache_dir
from .loader import adapter_path, load_model, resolve_source


def _key(cfg: ModelConfig, adapter: Path, dtype: str) -> str:
    h = hashlib.sha256(f"{cfg.name}\0{dtype}".encode())
    for f in sorted(p for p in adapter.iterdir() if p.is_file()):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def merged_checkpoint(cfg: ModelConfig, dtype: str) -> str:
    """The model directory (or hub id) that serves ``cfg`` with its adapter: ``resolve_source``'s
    answer when there is no adapter, else the merged checkpoint in ``dtype`` (``float32``,
    ``bfloat16``, ...), built on first use."""
    adapter = adapter_path(cfg)
    if adapter is None:
        return resolve_source(cfg.name)[0]
    dest = cache_dir() / "merged" / f"{Path(cfg.name).name.lower()}-{_key(cfg, adapter, dtype)}"
    if (dest / "config.json").is_file():
        return str(dest)
    print(f"[rig] merging the adapter {adapter} into {cfg.name} ({dtype}), once: {dest}", file=sys.stderr)
    # merged at full precision on the host whatever the serving quantization (vLLM quantizes on load)
    model, tokenizer = load_model(cfg.model_copy(update={"quantization": "none", "device": "cpu", "dtype": dtype,
                                                         "cpu_gemm": "torch"}))
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(dest)
