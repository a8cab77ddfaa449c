"""The parts of vLLM the vLLM backend uses, found where the installed release keeps them.

Everything vLLM-specific that the runner constructs goes through a ``VllmApi``: the request types
(``SamplingParams``, ``TokensPrompt``, ``StreamingInput``, ``RequestOutputKind``) and the engine
(``AsyncEngineArgs``, ``AsyncLLM``). ``load_vllm_api`` imports them; tests build one from stand-ins.

``StreamingInput`` (resumable requests) moved between releases: ``vllm.inputs``,
``vllm.engine.protocol`` (where 0.33.0 defines it) and ``vllm.v1.engine.async_llm`` are tried in
turn; None where the release has none (the runner then uses new requests and the prefix cache).
Quantization methods differ between releases too: 0.33.0 has no ``bitsandbytes``, so
``model.quantization: nf4`` is refused up front there rather than deep inside engine start-up.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

LOGITS_PROCESSOR = "rig_decode.engine.vllm_logits:RigMarkerLogitsProcessor"
"""The marker logits processor, by the ``module:Class`` name vLLM's engine process imports."""

MISSING = ("engine.backend: vllm needs vLLM in this environment: ./scripts/setup.sh --vllm installs it "
           "(vLLM's CPU build on a machine without CUDA, the CUDA build where there is CUDA)")

CPU_KV_CACHE_GIB = 2.0
"""KV-cache memory vLLM's CPU build gets unless ``engine.vllm.kv_cache_gib`` says: 2 GiB hold ~45k
tokens of the embedded default (30 layers x 3 KV heads x 64 x fp32)."""


class VllmMissingError(RuntimeError):
    pass


@dataclass(frozen=True)
class VllmApi:
    SamplingParams: Any
    TokensPrompt: Any
    RequestOutputKind: Any
    StreamingInput: Any = None
    """None where this vLLM has no resumable requests."""
    AsyncEngineArgs: Any = None
    AsyncLLM: Any = None
    version: str = "unknown"
    quantization_methods: tuple[str, ...] | None = None
    """The ``quantization=`` names this vLLM accepts; None where unknown."""
    device: str | None = None
    """The device this vLLM build runs on (``cpu``, ``cuda``, ...); None where unknown."""


def _first(candidates: list[tuple[str, str]]):
    for module, name in candidates:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    return None


def load_vllm_api() -> VllmApi:
    try:
        import vllm
    except ImportError as e:
        raise VllmMissingError(f"{MISSING} ({e})") from None
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine_args = _first([("vllm.engine.arg_utils", "AsyncEngineArgs"), ("vllm", "AsyncEngineArgs")])
    async_llm = _first([("vllm.v1.engine.async_llm", "AsyncLLM"), ("vllm.engine.async_llm_engine", "AsyncLLMEngine")])
    streaming = _first([("vllm.inputs", "StreamingInput"), ("vllm.engine.protocol", "StreamingInput"),
                        ("vllm.v1.engine.async_llm", "StreamingInput")])
    quant = _first([("vllm.model_executor.layers.quantization", "QUANTIZATION_METHODS")])
    platform = _first([("vllm.platforms", "current_platform")])
    if engine_args is None or async_llm is None:
        raise VllmMissingError(f"vLLM {vllm.__version__} has no AsyncEngineArgs / AsyncLLM where this backend "
                               "looks for them (vllm.engine.arg_utils, vllm.v1.engine.async_llm)")
    return VllmApi(SamplingParams, TokensPrompt, RequestOutputKind, streaming, engine_args, async_llm,
                   getattr(vllm, "__version__", "unknown"), None if quant is None else tuple(quant),
                   getattr(platform, "device_type", None))


def resolve_mode(mode: str, api: VllmApi) -> str:
    """``auto``: ``stream`` where this vLLM has resumable requests, else ``prefix``."""
    if mode == "auto":
        return "stream" if api.StreamingInput is not None else "prefix"
    if mode == "stream" and api.StreamingInput is None:
        raise ValueError(f"engine.vllm.mode: stream needs vLLM's StreamingInput (resumable requests), which vLLM "
                         f"{api.version} does not have; use mode: prefix or auto, or a newer vLLM")
    if mode not in ("stream", "prefix"):
        raise ValueError(f"engine.vllm.mode must be auto, stream or prefix, got {mode!r}")
    return mode


def engine_args_kwargs(cfg, api: VllmApi | None = None) -> dict:
    """``AsyncEngineArgs`` keyword arguments for a ``RigConfig`` (its ``model`` and ``engine.vllm``).
    ``api``: the vLLM they are for (its device decides the CPU defaults: fp32 like the in-process
    backend, eager, a KV cache of ``CPU_KV_CACHE_GIB``); ValueError where it lacks the quantization
    ``model`` asks for. A model with an adapter is served merged: the first call for an adapter
    merges it into a checkpoint in the cache (``models/merged.py``)."""
    import torch

    from ..models.loader import resolve_dtype, resolve_source
    from ..models.merged import merged_checkpoint

    model = cfg.served_model()
    if resolve_source(model.name)[1].get("gguf_file"):
        raise ValueError("engine.backend: vllm loads a HuggingFace model directory or hub id, not a .gguf file")
    v = cfg.engine.vllm
    device = (api.device if api is not None and getattr(api, "device", None) else
              "cuda" if torch.cuda.is_available() else "cpu")
    on_cpu = device == "cpu"
    # model.dtype auto resolves as the in-process backend resolves it, so both give the same tokens;
    # vLLM's own auto takes the checkpoint's dtype (bf16 for the embedded default)
    dtype = str(resolve_dtype(model.dtype, torch.device(device))).removeprefix("torch.")
    kwargs = dict(model=merged_checkpoint(model, dtype), dtype=dtype, max_model_len=v.max_model_len,
                  gpu_memory_utilization=v.gpu_memory_utilization,
                  enforce_eager=on_cpu if v.enforce_eager is None else v.enforce_eager,
                  enable_prefix_caching=True, seed=model.seed,
                  # the engine reads top_logprobs per position; vLLM refuses more than max_logprobs
                  max_logprobs=max(20, v.top_logprobs))
    kv_gib = v.kv_cache_gib if v.kv_cache_gib is not None else CPU_KV_CACHE_GIB if on_cpu else None
    if kv_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_gib * 2**30)
    if v.block_size is not None:
        kwargs["block_size"] = v.block_size
    if v.tensor_parallel_size > 1 or v.pipeline_parallel_size > 1 or v.distributed_executor_backend:
        kwargs.update(tensor_parallel_size=v.tensor_parallel_size, pipeline_parallel_size=v.pipeline_parallel_size,
                      distributed_executor_backend=v.distributed_executor_backend)
    if model.quantization == "nf4":
        kwargs["quantization"] = "bitsandbytes"
        if api is not None and api.quantization_methods is not None and "bitsandbytes" not in api.quantization_methods:
            raise ValueError(f"model.quantization: nf4 loads with vLLM's bitsandbytes quantization, which vLLM "
                             f"{api.version} does not have; serve a pre-quantized checkpoint (AWQ, GPTQ, ...: "
                             "vLLM reads it from config.json) with model.quantization: none, or use a vLLM that has it")
    if v.logits_processor:
        kwargs["logits_processors"] = [LOGITS_PROCESSOR]
    return kwargs
