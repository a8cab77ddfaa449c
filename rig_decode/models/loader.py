"""Load a causal LM and its tokenizer from an embedded default, a local path, a GGUF file or a hub id.

``quantization: nf4`` loads the weights in 4 bits with bitsandbytes (NF4, double quantisation,
bf16 compute); ``int8``/``int4`` quantize the linear layers after loading, weight-only, through
PyTorch's own kernels (``weight_only.py``). Device and dtype default to CUDA + bf16 when a
GPU is present, CPU + fp32 otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..adapters import adapter_settings, resolve_adapter
from .cpu_gemm import pack_linears, packing_available
from .embedded import EMBEDDED_MODELS, pull
from .quiet import quiet_peft
from .weight_only import QUANTIZATIONS, quantize_linears

if TYPE_CHECKING:
    from ..config import ModelConfig


class ModelLoadError(RuntimeError):
    pass


def resolve_device(pref: str = "auto") -> torch.device:
    if pref == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("model.device is 'cuda' but CUDA is not available")
    if pref == "auto":
        pref = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(pref)


def resolve_dtype(pref: str, device: torch.device) -> torch.dtype:
    if pref == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, pref)


def nf4_config():
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ModelLoadError("quantization: nf4 needs bitsandbytes (pip install 'rig_decode[gpu]')") from None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def resolve_source(name: str) -> tuple[str, dict]:
    """(path or hub id, extra from_pretrained kwargs) for a ``model.name``."""
    if name.lower() in EMBEDDED_MODELS:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return str(pull(name.lower())), {}
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return str(path.parent), {"gguf_file": path.name}
    if path.exists() or name.startswith((".", "/", "~")):
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model directory {path} has no config.json")
        return str(path), {}
    return name, {}  # a hub id: the user's environment decides whether it may be downloaded


def adapter_path(cfg: ModelConfig) -> Path | None:
    """The adapter folder ``cfg`` asks for (None: none), checked to hold an adapter."""
    folder = resolve_adapter(cfg.name, cfg.adapter)
    if folder is not None and not (folder / "adapter_config.json").is_file():
        raise ModelLoadError(f"model.adapter {folder} has no adapter_config.json")
    return folder


def load_tokenizer(cfg: ModelConfig):
    """The tokenizer ``load_model`` would return: an adapter's own when it saved one, else the
    model's with the marker tokens the adapter added (``rig_adapter.json``), in the same order."""
    from transformers import AutoTokenizer

    adapter = adapter_path(cfg)
    if adapter is not None and (adapter / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(adapter))
    source, extra = resolve_source(cfg.name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **extra)
    except OSError as e:
        raise ModelLoadError(f"cannot load the tokenizer of {cfg.name!r}: {e}") from e
    try:
        added = adapter_settings(adapter).get("added_tokens", [])
    except ValueError as e:
        raise ModelLoadError(f"model.adapter: {e}") from None
    if added:
        tokenizer.add_tokens(added, special_tokens=True)
    return tokenizer


def load_model(cfg: ModelConfig):
    """(model, tokenizer) for a ``model:`` config section. A LoRA ``adapter`` (a folder written by
    ``scripts/train_markers.py``) is merged into the weights, so decoding costs nothing extra; when
    it carries a tokenizer with added marker tokens, that tokenizer is used and the embeddings are
    resized to it first. On CPU in fp32 the linear layers are then packed for oneDNN
    (``model.cpu_gemm``), which makes the model inference-only."""
    from transformers import AutoModelForCausalLM

    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    source, extra = resolve_source(cfg.name)
    kwargs = dict(extra, dtype=dtype)
    if cfg.quantization == "nf4":
        kwargs["quantization_config"] = nf4_config()
        kwargs["device_map"] = {"": device.index or 0} if device.type == "cuda" else {"": "cpu"}
    tokenizer = load_tokenizer(cfg)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except OSError as e:
        raise ModelLoadError(f"cannot load model {cfg.name!r}: {e}") from e
    if cfg.quantization != "nf4":
        model.to(device)
    adapter = adapter_path(cfg)
    if adapter is not None:
        with quiet_peft():
            try:
                from peft import PeftModel
            except ImportError:
                raise ModelLoadError("model.adapter needs peft (pip install peft)") from None
            if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
                model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
            model = PeftModel.from_pretrained(model, str(adapter))
            if cfg.quantization != "nf4":
                model = model.merge_and_unload()
    model.eval()
    if cfg.quantization in QUANTIZATIONS:  # after the adapter is merged in: its weights are quantized too
        quantize_linears(model, cfg.quantization)
    if cfg.cpu_gemm != "torch" and device.type == "cpu" and dtype == torch.float32 and cfg.quantization == "none":
        if packing_available():
            pack_linears(model)
        elif cfg.cpu_gemm == "packed":
            raise ModelLoadError("model.cpu_gemm is 'packed' but this torch build has no oneDNN linear packing")
    return model, tokenizer
