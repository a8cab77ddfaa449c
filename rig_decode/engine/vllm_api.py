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

MISSING = ("engine.backend: vllm needs vLLM in this environment: pip install 'rig_decode[vllm]' "
           "(a CUDA build of torch comes with it)")


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
    if engine_args is None or async_llm is None:
        raise VllmMissingError(f"vLLM {vllm.__version__} has no AsyncEngineArgs / AsyncLLM where this backend "
                               "looks for them (vllm.engine.arg_utils, vllm.v1.engine.async_llm)")
    return VllmApi(SamplingParams, TokensPrompt, RequestOutputKind, streaming, engine_args, async_llm,
                   getattr(vllm, "__version__", "unknown"), None if quant is None else tuple(quant))


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
    ``api``: the vLLM they are for; ValueError where it lacks the quantization ``model`` asks for."""
    from ..models.loader import resolve_source

    model = cfg.served_model()
    source, extra = resolve_source(model.name)
    if extra.get("gguf_file"):
        raise ValueError("engine.backend: vllm loads a HuggingFace model directory or hub id, not a .gguf file")
    v = cfg.engine.vllm
    kwargs = dict(model=source, dtype=model.dtype, max_model_len=v.max_model_len,
                  gpu_memory_utilization=v.gpu_memory_utilization, enforce_eager=v.enforce_eager,
                  enable_prefix_caching=True, seed=model.seed,
                  # the engine reads top_logprobs per position; vLLM refuses more than max_logprobs
                  max_logprobs=max(20, v.top_logprobs))
    if model.quantization == "nf4":
        kwargs["quantization"] = "bitsandbytes"
        if api is not None and api.quantization_methods is not None and "bitsandbytes" not in api.quantization_methods:
            raise ValueError(f"model.quantization: nf4 loads with vLLM's bitsandbytes quantization, which vLLM "
                             f"{api.version} does not have; serve a pre-quantized checkpoint (AWQ, GPTQ, ...: "
                             "vLLM reads it from config.json) with model.quantization: none, or use a vLLM that has it")
    if v.logits_processor:
        kwargs["logits_processors"] = [LOGITS_PROCESSOR]
    return kwargs
