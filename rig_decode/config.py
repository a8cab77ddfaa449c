"""Configuration: one YAML file, validated at load time.

The schema mirrors what RIG users already write (model / retriever / rig / server sections).
Every section forbids unknown keys, and every error names the key path that caused it, e.g.
``rig.max_iterations: Input should be greater than or equal to 0 (got -1)``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .models.embedded import DEFAULT_MODEL


class ConfigError(ValueError):
    """A configuration file or dict that cannot be used; the message names the key path."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ModelConfig(_Section):
    name: str = Field(DEFAULT_MODEL, min_length=1)
    """An embedded default name, a local directory, a ``.gguf`` file or a HuggingFace id."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Literal["none", "nf4", "int8", "int4"] = "none"
    """``nf4``: bitsandbytes 4-bit; ``int8``/``int4``: weight-only through PyTorch's own kernels, the LM
    head included (``models/weight_only.py``; docs/performance.md compares them)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    cpu_gemm: Literal["auto", "packed", "torch"] = "auto"
    """fp32 on CPU: ``packed`` oneDNN pre-packed weights (inference), ``torch`` plain ``F.linear``
    (training), ``auto`` packed where supported (``models/cpu_gemm.py``)."""
    adapter: str | None = "auto"
    """A LoRA marker adapter folder; ``auto``: the one shipped for an embedded model; null: none."""
    max_tokens: int = Field(512, ge=1)
    """Tokens the model may sample per request (evidence tokens do not count)."""
    temperature: float = Field(0.0, ge=0.0)
    """0 means greedy decoding."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int = 0


class RerankerConfig(_Section):
    type: Literal["auto", "links", "none", "cross-encoder", "flashrank"] = "auto"
    """``auto``: the shipped default, ``links`` (no model: the best hit, then the candidates whose
    title it names); ``cross-encoder``: an ONNX cross-encoder in ``model_dir`` (as written by
    ``scripts/train_reranker.py``); ``flashrank``: ``model`` under ``model_dir``; ``none``: fusion order."""
    model: str = "ms-marco-TinyBERT-L-2-v2"
    """The flashrank model's name (``type: flashrank`` only)."""
    model_dir: str | None = None
    """``cross-encoder``: the model's folder (required); ``flashrank``: the folder holding
    ``<model>/`` in flashrank's layout (default: <cache>/rerankers). Never downloaded."""
    top_n: int | None = Field(None, ge=1)
    """Hits kept after reranking, at most; None: as many as the search asks for (``top_k``)."""
    candidates: int = Field(10, ge=1)
    budget_ms: float = Field(200.0, gt=0)
    """Per query: queries beyond what the budget predicts keep the fusion order (recorded)."""

    @model_validator(mode="after")
    def _cross_encoder_needs_a_folder(self):
        if self.type == "cross-encoder" and not self.model_dir:
            raise ValueError("reranker.type cross-encoder needs reranker.model_dir (the model's folder)")
        return self


class MilvusConfig(_Section):
    uri: str = "rig_milvus.db"
    """A local file (embedded Milvus Lite) or a server URI (http://host:19530)."""
    collection: str = "rig_decode"
    token: str | None = None


class RetrieverConfig(_Section):
    type: Literal["faiss", "bm25", "hybrid", "milvus", "python"] = "hybrid"
    """``python``: what ``factory`` (``package.module:callable``) returns for ``factory_args``."""
    factory: str | None = Field(None, pattern=r"^[\w.]+:[\w.]+$")
    factory_args: dict[str, Any] = Field(default_factory=dict)
    top_k: int = Field(3, ge=1, le=100)
    score_threshold: float = Field(0.2, ge=-1.0, le=1.0)
    """Minimum cosine similarity of a dense hit (BM25 hits need a positive score)."""
    embedding_model: str = Field("all-minilm-l6-v2", min_length=1)
    index_path: str | None = None
    """A built index directory. None: the bundled demo knowledge base, indexed on first use."""
    timeout_s: float = Field(10.0, gt=0)
    """A search that takes longer is abandoned; the hop continues with a no-evidence block."""
    alpha: float = Field(0.7, ge=0.0, le=1.0)
    """Weight of the dense side in alpha fusion (1 - alpha goes to BM25)."""
    fusion: Literal["alpha", "rrf"] = "alpha"
    candidates: int = Field(20, ge=1)
    """Candidates taken from each side before fusion."""
    router: bool = True
    """Shift weight to BM25 for queries with ids, codes, versions, numbers or quoted strings."""
    router_alpha: float = Field(0.3, ge=0.0, le=1.0)
    typo_similarity: float | None = Field(0.8, gt=0.0, le=1.0)
    """Query words the index lacks become the closest indexed word at least this alike (normalised
    Indel similarity; letters-only words of 4+), so a misspelt name still matches. None: off."""
    index_type: Literal["auto", "flat", "ivf", "hnsw"] = "auto"
    ann_threshold: int = Field(50_000, ge=1)
    """Above this many chunks, ``auto`` uses an approximate (HNSW) index instead of exact search."""
    query_cache_size: int = Field(1024, ge=0)
    namespace: str | None = None
    filters: dict[str, Any] = Field(default_factory=dict)
    """Applied to every search, e.g. ``{status: active, valid_until: {gte: today}}``."""
    reranker: RerankerConfig = RerankerConfig()
    milvus: MilvusConfig = MilvusConfig()

    @model_validator(mode="after")
    def _python_needs_a_factory(self):
        if (self.type == "python") != (self.factory is not None):
            raise ValueError("retriever.type python and retriever.factory (package.module:callable) go together")
        return self


class GateRuleConfig(_Section):
    pattern: str = Field(min_length=1)
    """A regular expression matched (case-insensitively) against the question."""
    sensitivity: float = Field(ge=0.0, le=1.0)
    """1 = always retrieve when it matches."""

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"not a valid regular expression: {e}") from None
        return v


class GateConfig(_Section):
    """Adaptive retrieval gating (``gate.py``): veto low-need hops, optionally boost uncertain ones."""

    enabled: bool = False
    threshold: float = Field(0.45, ge=0.0, le=1.0)
    consider: float = Field(0.05, gt=0.0, le=1.0)
    weights: dict[Literal["marker_prob", "entropy", "need", "domain"], float] = {
        "marker_prob": 1.0, "entropy": 0.5, "need": 2.0, "domain": 1.0}
    entropy_scale: float = Field(4.0, gt=0.0)
    rules: list[GateRuleConfig] = []
    boost: bool = False
    boost_entropy: float = Field(3.0, ge=0.0)
    boost_bias: float = Field(4.0, ge=0.0)


class RigLoopConfig(_Section):
    max_iterations: int = Field(3, ge=0, le=64)
    marker_style: Literal["special_token", "json"] = "special_token"
    append_format: Literal["full", "summary"] = "full"
    """``summary``: when a hop's evidence arrives, earlier evidence blocks leave the KV cache (keys
    after them re-rotated, ``kernels/``); the model's own text after each block stays as its
    summary. Bounds the context of long multi-hop answers; in-process (hf) backend only."""
    max_query_tokens: int = Field(48, ge=1)
    evidence_token_budget: int = Field(384, ge=16)
    newline_ends_query: bool = True
    """A line break inside a query closes it (for models not trained on the end marker)."""
    retrieve_first: bool = False
    """Force a retrieve marker at the start of every answer (the model still writes the query)."""
    gate: GateConfig = GateConfig()
    reuse_similarity: float | None = Field(0.8, ge=0.0, le=1.0)
    """A hop whose query is this similar (word-set Jaccard) to an earlier query of the same answer
    or conversation references the documents that query found instead of searching again, while
    they are still in context (with ``append_format: summary`` only those in the prompt); null: off."""
    citations: bool = False
    """Let the model cite evidence as ``[n]``, constrained to documents it has seen; citations are
    listed (with doc ids) and checked against the cited text in the trace and the API response."""
    show_markers: bool = False
    """Keep marker and evidence text in the returned answer."""
    system_prompt: str | None = None
    """Replaces the built-in instruction that teaches the model the marker syntax."""
    deadline_s: float | None = Field(None, gt=0)
    """Wall-clock limit per request; past it the request finishes with what it has."""


class RemoteConfig(_Section):
    """A completion server that runs the model (``engine.backend: remote``); see ``engine/runner_remote.py``."""

    base_url: str | None = None  # e.g. http://127.0.0.1:8080 (llama-server), http://127.0.0.1:8000 (vLLM)
    api: Literal["auto", "llama.cpp", "openai"] = "auto"
    """``llama.cpp``: llama-server's native /completion; ``openai``: /v1/completions with token-id
    prompts and token ids back (vLLM); ``auto``: llama.cpp when the server answers /props."""
    api_key: str | None = None
    model: str | None = None
    """The served model's name, for the OpenAI API (default: the server's first model)."""
    stream: bool = True
    """One streamed request per stretch between hops (``engine/runner_stream.py``); false: requests
    of ``lookahead`` tokens, ``parallel`` at once (``engine/runner_remote.py``)."""
    lookahead: int = Field(16, ge=1, le=512)
    top_logprobs: int = Field(20, ge=1, le=100)
    """Top log-probabilities per position: what the engine's masks and sampling choose among."""
    parallel: int = Field(4, ge=1, le=256)
    timeout_s: float = Field(120.0, gt=0)


class VllmConfig(_Section):
    """vLLM in this process (``engine.backend: vllm``); see ``engine/runner_vllm.py``."""

    mode: Literal["auto", "stream", "prefix"] = "auto"
    """``stream``: one resumable request per row (``StreamingInput``), its KV kept across hops; ``prefix``:
    a request per call, the prefix cache holding earlier tokens; ``auto``: stream where vLLM has it."""
    max_model_len: int = Field(8192, ge=16)
    """Tokens a row may hold: prompt, generation and every hop's evidence."""
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    """On a GPU: the share of its memory vLLM takes (weights, activations, KV cache)."""
    kv_cache_gib: float | None = Field(None, gt=0.0)
    """KV-cache GiB. null: ``vllm_api.CPU_KV_CACHE_GIB`` on a CPU (vLLM's CPU build would reserve
    ``gpu_memory_utilization`` of the RAM), on a GPU what ``gpu_memory_utilization`` leaves."""
    enforce_eager: bool | None = None
    """No graph capture or compile: faster start, slower decode. null: eager on a CPU, graphs on a GPU."""
    block_size: int | None = Field(None, ge=1)
    """Tokens per KV block (prefix-cache granularity). null: the platform's (128 CPU, 16 CUDA)."""
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    distributed_executor_backend: Literal["mp", "ray", "uni", "external_launcher"] | None = None
    """Past one GPU: the model split over tensor x pipeline GPUs, their workers run by this (null: vLLM's pick)."""
    top_logprobs: int = Field(20, ge=1, le=100)
    """Top log-probabilities per position: what the engine's masks and sampling choose among."""
    lookahead: int = Field(16, ge=1, le=512)
    """Tokens per request in prefix mode (a stream-mode chunk asks for the rest of the row)."""
    logits_processor: bool = False
    """Register the marker logits processor with vLLM (``engine/vllm_logits.py``); needs the markers
    as single tokens. The engine's own processors decide either way."""


class ZeroPrefillConfig(_Section):
    """Evidence spliced from per-piece KV computed once, alone (``kernels/chunk_kv.py``): no prefill
    of the reused tokens, at some cost in accuracy (they never attended to the context)."""

    enabled: bool = False
    recompute: float = Field(0.1, ge=0.0, le=1.0)
    """Share of each evidence block (at least its last token) computed with full attention."""
    select: Literal["tail", "deviation"] = "tail"
    """Which tokens: ``tail``, the block's last ones; ``deviation``, its last one and those whose
    layer-1 values in context differ most from the reused ones (CacheBlend; a two-layer pass over
    the block finds them; ``bench/zero_prefill_select.py`` compares the two)."""
    store_mb: int = Field(256, ge=0)
    """Bytes of piece KV kept (least recently used dropped first), on the model's device."""
    host_store_mb: int = Field(0, ge=0)
    """Bytes of piece KV kept in host memory (pinned, for a GPU model) once ``store_mb`` is full: a
    hit there costs a copy to the device, not a forward (a 32B model: 256 KiB per token)."""


class EngineConfig(_Section):
    backend: Literal["hf", "remote", "vllm"] = "hf"
    """``hf``: the model runs in this process (transformers); ``remote``: a completion server runs
    it (``engine.remote``), fed token ids, with the same retrieval loop, masks and trace; ``vllm``:
    vLLM runs it in this process (``engine.vllm``), likewise."""
    remote: RemoteConfig = RemoteConfig()
    vllm: VllmConfig = VllmConfig()
    max_batch_size: int = Field(16, ge=1)
    kv_budget: Literal["auto"] | int | None = "auto"
    """KV-cache token slots: ``auto`` (from the memory left after loading the model), a number, or
    null (no limit). Requests beyond it wait in the queue."""
    retrieval_retries: int = Field(1, ge=0, le=10)
    max_hung_searches: int = Field(4, ge=1)
    """Abandoned searches (past ``retriever.timeout_s``) still running before retrieval is reported
    degraded (``/health``): hops then get a no-evidence block at once, until one returns."""
    sync_retrieval: bool = False
    """Search inside the decode step (the other rows wait); for comparison only."""
    prefill_chunk_tokens: int | None = Field(512, ge=1)
    """Tokens one prefill forward takes at most (a prompt, an evidence block, rows joining): a longer
    one runs in chunks, so its activations are bounded by the chunk (``rig plan`` counts them);
    null: no bound."""
    decode_step: Literal["auto", "hf", "graph", "compiled"] = "auto"
    """How a decode step runs: ``hf`` through the model's HF modules; ``graph`` one function of tensors
    over the KV buffers (``models.decode_graph``); ``compiled`` that through ``torch.compile`` (a CUDA
    graph on CUDA); ``auto``: compiled on CUDA and for weight-only quantized models on CPU, else ``hf``."""
    zero_prefill: ZeroPrefillConfig = ZeroPrefillConfig()

    @model_validator(mode="after")
    def _remote_needs_a_url(self):
        if self.backend == "remote" and not self.remote.base_url:
            raise ValueError("engine.remote.base_url is required when engine.backend is remote")
        return self


class ApiKeyConfig(_Section):
    """A client's key (or ``key_env``, the variable holding it), named for ``/metrics``, optionally
    holding its searches to a ``namespace`` and ``filters`` (over ``retriever.filters``)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    key: str | None = Field(None, min_length=8)
    key_env: str | None = Field(None, min_length=1)
    namespace: str | None = None
    filters: dict[str, Any] = Field(default_factory=dict)


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    api_key: str | None = None
    """When set, /v1 requests need ``Authorization: Bearer <api_key>`` (the key named ``default``)."""
    api_keys: list[ApiKeyConfig] = Field(default_factory=list)
    """A conversation id is visible only to the key that created it."""
    max_concurrency: int = Field(64, ge=1)
    """Requests in flight (building their prompt, queued for a batch slot, decoding); more get 429."""
    model_name: str | None = None
    """The model id clients use (default: ``model.name``)."""
    max_request_bytes: int = Field(4 * 2**20, ge=1024)
    """Request bodies past this get a 413 before they are read whole."""
    max_prompt_chars: int | None = Field(None, ge=1)
    """Longer text is refused before tokenising (default: context length x the longest token)."""

    @model_validator(mode="after")
    def _keys(self):
        names = [k.name for k in self.api_keys] + ["default"] * bool(self.api_key)
        if len(set(names)) < len(names):
            raise ValueError("api_keys: every key needs its own name (api_key is named 'default')")
        for k in self.api_keys:
            if (k.key is None) == (k.key_env is None):
                raise ValueError(f"api_keys {k.name!r}: give exactly one of key, key_env")
        return self


class RigConfig(_Section):
    model: ModelConfig = ModelConfig()
    retriever: RetrieverConfig = RetrieverConfig()
    rig: RigLoopConfig = RigLoopConfig()
    engine: EngineConfig = EngineConfig()
    server: ServerConfig = ServerConfig()

    @model_validator(mode="after")
    def _backend_supports_loop(self):
        backend = {"remote": "a remote server", "vllm": "vLLM"}.get(self.engine.backend)
        if backend and self.rig.append_format == "summary":
            raise ValueError(f"rig.append_format: summary drops evidence from the KV cache, which {backend} "
                             "does not expose; use engine.backend: hf")
        if backend and self.engine.zero_prefill.enabled:
            raise ValueError(f"engine.zero_prefill copies KV into the cache, which {backend} does not "
                             "expose; use engine.backend: hf")
        return self

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, source: str = "config") -> "RigConfig":
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: top level must be a mapping, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(f"{source}: " + "; ".join(_describe(err) for err in e.errors())) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> "RigConfig":
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from None
        return cls.from_dict(data, source=str(path))

    def served_model(self) -> ModelConfig:
        """``model`` as the backend runs it. A remote server loads its own weights: ``adapter: auto``
        means none there (a folder named still gives tokenizer and prompt, for a merged model). vLLM
        serves the adapter merged into a checkpoint of its own (``models/merged.py``)."""
        if self.engine.backend == "remote" and self.model.adapter == "auto":
            return self.model.model_copy(update={"adapter": None})
        return self.model

    def system_prompt(self) -> str | None:
        """``rig.system_prompt``, else the prompt the model's adapter was trained with, else None (the
        built-in marker instruction); with ``rig.citations``, asking for ``[n]`` citations."""
        from .prompt import with_cite_instruction

        prompt = self.rig.system_prompt
        if prompt is None:
            from .adapters import adapter_settings, resolve_adapter

            model = self.served_model()
            try:
                prompt = adapter_settings(resolve_adapter(model.name, model.adapter)).get("system_prompt")
            except ValueError as e:
                raise ConfigError(f"model.adapter: {e}") from None
        return with_cite_instruction(prompt) if prompt is not None and self.rig.citations else prompt

    def updated(self, **sections: dict[str, Any]) -> "RigConfig":
        """A copy with some keys of some sections replaced, validated like a file would be."""
        data = self.model_dump()
        for name, values in sections.items():
            data.setdefault(name, {}).update(values)
        return RigConfig.from_dict(data, source="override")


def _describe(err: dict[str, Any]) -> str:
    path = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"{path}: unknown key"
    if err["type"] == "value_error":  # our own validators name the key in the message
        msg = err["msg"].removeprefix("Value error, ")
        return f"{path}: {msg}" if path else msg
    return f"{path}: {err['msg']} (got {err.get('input')!r})"
