"""GPU memory: the planner behind ``rig plan`` and the token budget the scheduler admits by.

The plan counts what a card holds while serving, each as a line of ``rig plan``:

* weights - every linear layer of the decoder in the chosen format. ``nf4`` (bitsandbytes, double
  quantisation): 4 bits plus one 8-bit absmax per 64 weights plus one fp32 scale per 256 absmax
  values, 4 + 8/64 + 32/(64*256) = 4.127 bits; the LM head stays in the compute dtype.
  ``int4`` (``models.weight_only``): 4 bits plus a bf16 scale and zero per 128 input channels,
  4 + 32/128 = 4.25 bits; ``int8``: 8 bits plus a bf16 scale per output channel; both quantize
  the LM head too. Embeddings and norms stay in the compute dtype.
* KV - ``2 (K and V) x layers x kv_heads x head_dim x bytes`` per token, e.g. Qwen2.5-32B in bf16:
  2 x 64 x 8 x 128 x 2 B = 256 KiB per token; the plan holds ``sequences x context`` tokens.
* prefill activations - the peak of one forward of a prefill chunk beside weights and KV
  (``prefill_activation_bytes``): one layer's transients at a time, so it does not grow with the
  layers, and bounded by the chunk except for the attention's keys and values, which grow with the
  context.
* shared prefix - the runner's copy of the longest prompt start it may share with later prompts
  (a system prompt, an earlier turn): at most ``SHARED_PREFIX_TOKENS`` tokens of KV.
* decode graph pool - what a compiled decode step replayed as a CUDA graph keeps in its pool: the
  step's activations at the planned rows and columns (``decode_graph_bytes``).
* index - the retrieval index's vectors on the card (float32, flat) and FAISS's GPU scratch.
* outside torch - what the card holds beside torch's allocator: the CUDA context and kernel images
  (0.686 GiB measured on an H200 by ``bench/gpu.py``; torch's ``max_memory_*`` never see it).

What is left after everything but the KV is the KV budget; the margin is the card less every line.
Not counted: the caching allocator's fragmentation (reserved but unallocated), which the margin
has to absorb.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

GiB, MiB = 1024**3, 1024**2
NF4_BITS = 4 + 8 / 64 + 32 / (64 * 256)
INT4_GROUP = 128  # input channels per int4 scale and zero (models.weight_only.INT4_GROUP)
QUANTIZATIONS = ("nf4", "int4", "int8", "none")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
OUTSIDE_TORCH = int(0.7 * GiB)  # CUDA context + kernel images: 0.686 GiB on an H200 (bench/gpu.py)
FAISS_GPU_SCRATCH = int(1.5 * GiB)  # StandardGpuResources' temporary memory on a card over 8 GiB
SHARED_PREFIX_TOKENS = 1024  # the runner keeps at most this much of a prompt's start as a shared prefix
KV_HEADROOM, KV_MIN_SPARE = 0.25, 64  # a KV buffer's spare columns (models.kv_buffers.BufferedLayer)

# One prefill forward's transients, in [tokens x width] tensors of the compute dtype: counted from
# HF's Qwen2 forward and fitted to bench/prefill_memory.py at Qwen2.5-32B widths, per layer measured
# apart (docs/benchmarks.md, "Prefill memory by chunk (Qwen2.5-32B widths)"):
HIDDEN_COPIES = 4  # [tokens, hidden] held across a layer: embeddings, the layer's input, residual, normed
MLP_COPIES = 3  # [tokens, intermediate]: act(gate), up and their product (3.0 measured, chunk 2048 and none)
QKV_COPIES = 4  # [tokens, q + 2 kv]: projections, rotated copies, the attention's output (2.5-3.7 measured)
WORKSPACE = 32 * MiB  # a matmul's scratch and the small tensors: what is left, 25-32 MiB measured

# Architectures people plan for, so that `rig plan` works offline (values from their config.json).
KNOWN = {
    "Qwen/Qwen2.5-32B-Instruct": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                                      num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                                      tie_word_embeddings=False, attention_bias=True),
    "Qwen/Qwen2.5-7B-Instruct": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                     num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                     tie_word_embeddings=False, attention_bias=True),
    "meta-llama/Llama-3.1-8B-Instruct": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                             num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                             tie_word_embeddings=False, attention_bias=False),
    "smollm2-135m-instruct": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                  num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                  tie_word_embeddings=True, attention_bias=False),
}
ALIASES = {"qwen2.5-32b": "Qwen/Qwen2.5-32B-Instruct", "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct",
           "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct"}


@dataclass(frozen=True, slots=True)
class Architecture:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    head_dim: int = 0

    def __post_init__(self):
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)

    @classmethod
    def from_config(cls, cfg: dict) -> "Architecture":
        keys = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in cfg.items() if k in keys and v is not None})

    @property
    def q_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def layer_linears(self) -> list[tuple[int, int]]:
        """(out, in) of one decoder layer's linear layers: q, k, v, o, gate, up, down."""
        h, q, kv, inter = self.hidden_size, self.q_width, self.kv_width, self.intermediate_size
        return [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter)]

    @property
    def linear_params(self) -> int:
        """Weights of the decoder's linear layers (what 4-bit quantisation applies to)."""
        return self.num_hidden_layers * sum(o * i for o, i in self.layer_linears())

    @property
    def other_params(self) -> int:
        """Embeddings, LM head, norms and biases (kept in the compute dtype)."""
        h = self.hidden_size
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        norms = self.num_hidden_layers * 2 * h + h
        bias = self.num_hidden_layers * (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim \
            if self.attention_bias else 0
        return embed + norms + bias

    def kv_bytes_per_token(self, kv_dtype: str = "bfloat16") -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * DTYPE_BYTES[kv_dtype]


def resolve_architecture(model: str) -> tuple[str, Architecture]:
    name = ALIASES.get(model.lower(), model)
    if name in KNOWN:
        return name, Architecture(**KNOWN[name])
    path = Path(model).expanduser()
    cfg_file = path / "config.json" if path.is_dir() else path
    if cfg_file.is_file():
        return model, Architecture.from_config(json.loads(cfg_file.read_text()))
    try:
        from transformers import AutoConfig

        return model, Architecture.from_config(AutoConfig.from_pretrained(model).to_dict())
    except Exception as e:  # noqa: BLE001 - offline, unknown id, ...
        raise ValueError(f"cannot find the architecture of {model!r} ({e}); known offline: "
                         f"{', '.join(KNOWN)}; or pass a config.json path") from None


def quantized_bytes(out_features: int, in_features: int, quantization: str, dtype: str = "bfloat16") -> int:
    """Bytes of one ``out x in`` linear weight in ``quantization`` (as ``models.weight_only`` stores
    int8 and int4, as bitsandbytes stores nf4)."""
    n = out_features * in_features
    if quantization == "int8":  # + a bf16 scale per output channel
        return n + 2 * out_features
    if quantization == "int4":  # + a bf16 scale and zero per group: 4.25 bits at groups of 128
        group = INT4_GROUP
        while in_features % group and group > 32:
            group //= 2
        return n // 2 + 4 * out_features * (in_features // group)
    return int(n * (NF4_BITS if quantization == "nf4" else 8 * DTYPE_BYTES[dtype]) / 8)


def weights_bytes(arch: Architecture, quantization: str = "nf4", dtype: str = "bfloat16") -> int:
    """The model's weights on the card: nf4 leaves the LM head in ``dtype``, int8 and int4 quantize
    it (a tied head becomes a quantized copy beside the embeddings)."""
    if quantization in ("nf4", "none"):
        bits = NF4_BITS if quantization == "nf4" else 8 * DTYPE_BYTES[dtype]
        return int(arch.linear_params * bits / 8 + arch.other_params * DTYPE_BYTES[dtype])
    embed = arch.vocab_size * arch.hidden_size
    rest = arch.other_params - embed * (1 if arch.tie_word_embeddings else 2)  # norms, biases
    layers = arch.num_hidden_layers * sum(quantized_bytes(o, i, quantization) for o, i in arch.layer_linears())
    head = quantized_bytes(arch.vocab_size, arch.hidden_size, quantization)
    return layers + head + (embed + rest) * DTYPE_BYTES[dtype]


def prefill_activation_bytes(arch: Architecture, chunk: int, context: int, dtype: str = "bfloat16",
                             quantization: str = "none", rows: int = 1) -> int:
    """Peak bytes one prefill forward of ``chunk`` tokens, the last of a ``context``-token prompt,
    holds beside weights and KV. The layers run one after the other and free their transients, so
    the number of layers does not enter: what is held across layers (``HIDDEN_COPIES`` hidden states
    and the ``[chunk, context]`` causal mask), plus the larger of the MLP's transients and the
    attention's. Those of the attention include, once the chunk attends to a cache (with a mask,
    HF's sdpa path repeats the KV heads itself rather than pass GQA to the kernel), the keys and
    values repeated per query head over the whole context: the one term that grows with the
    context, not with the chunk. Plus a matmul's scratch, the last token's logits (and their fp32
    copy), and for nf4 one dequantized weight (bitsandbytes dequantizes a 4-bit weight for a matmul
    over many tokens; the int4 and int8 kernels read the packed weight)."""
    b, c = DTYPE_BYTES[dtype], min(chunk, context)
    held = HIDDEN_COPIES * c * arch.hidden_size * b + (c * context if context > c else 0)
    mlp = MLP_COPIES * c * arch.intermediate_size * b
    attn = QKV_COPIES * c * (arch.q_width + 2 * arch.kv_width) * b
    if context > c and arch.kv_width < arch.q_width:
        attn += 2 * context * arch.q_width * b
    logits = rows * arch.vocab_size * (b + 4)
    dequant = max(o * i for o, i in arch.layer_linears()) * b if quantization == "nf4" else 0
    return held + max(mlp, attn) + WORKSPACE + logits + dequant


def buffer_columns(context: int) -> int:
    """Columns of a KV buffer holding ``context`` tokens: its spare quarter (``BufferedLayer``)."""
    return context + max(KV_MIN_SPARE, int(context * KV_HEADROOM))


def decode_graph_bytes(arch: Architecture, rows: int, columns: int, dtype: str = "bfloat16") -> int:
    """The pool of a decode step replayed as a CUDA graph (``models.decode_graph``): its static
    inputs (ids, positions, columns, the ``[rows, columns]`` mask), its fp32 logits, and one layer's
    transients at ``rows`` tokens. Its attention has a mask and GQA, which sdpa's flash kernel does
    not take, so it is counted as the math kernel runs it: keys and values repeated per query head
    over every column, and fp32 scores with their softmax. An estimate from the step's shapes (no
    CUDA here to measure on): small at a few rows, but it grows with rows x columns."""
    b = DTYPE_BYTES[dtype]
    attn = 2 * rows * columns * arch.q_width * b + 2 * rows * arch.num_attention_heads * columns * 4
    mlp = MLP_COPIES * rows * arch.intermediate_size * b
    static = rows * columns + 3 * rows * 8 + rows * arch.vocab_size * (b + 4)
    return static + HIDDEN_COPIES * rows * arch.hidden_size * b + max(attn, mlp)


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Every line of ``rig plan``, in bytes. ``margin_bytes``: the card less all of them;
    ``max_kv_tokens``: the KV the card has room for beside everything else (the engine's budget)."""

    model: str
    quantization: str
    dtype: str
    kv_dtype: str
    gpu_bytes: int
    weights_bytes: int
    activation_bytes: int
    graph_pool_bytes: int
    index_bytes: int
    index_scratch_bytes: int
    outside_torch_bytes: int
    prefix_bytes: int
    kv_bytes_per_token: int
    sequences: int
    context_tokens: int
    prefill_chunk_tokens: int | None
    index_vectors: int = 0
    index_dim: int = 0

    @property
    def kv_bytes(self) -> int:
        return self.sequences * self.context_tokens * self.kv_bytes_per_token

    @property
    def fixed_bytes(self) -> int:
        """Everything but the KV."""
        return (self.weights_bytes + self.activation_bytes + self.graph_pool_bytes + self.index_bytes
                + self.index_scratch_bytes + self.outside_torch_bytes + self.prefix_bytes)

    @property
    def total_bytes(self) -> int:
        return self.fixed_bytes + self.kv_bytes

    @property
    def margin_bytes(self) -> int:
        return self.gpu_bytes - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.margin_bytes >= 0

    @property
    def max_kv_tokens(self) -> int:
        return max(0, self.gpu_bytes - self.fixed_bytes) // self.kv_bytes_per_token

    def to_dict(self) -> dict:
        derived = ("kv_bytes", "fixed_bytes", "total_bytes", "margin_bytes", "fits", "max_kv_tokens")
        return {**asdict(self), **{k: getattr(self, k) for k in derived}}

    def table(self) -> str:
        chunk, ctx, seqs = self.prefill_chunk_tokens, self.context_tokens, self.sequences
        head = "LM head in " + (self.quantization if self.quantization in ("int4", "int8") else self.dtype)
        bits = {"nf4": NF4_BITS, "int4": 4 + 32 / INT4_GROUP, "int8": 8}.get(self.quantization)
        weights = (f"{self.quantization}: {bits:.4g} bits per linear weight, " if bits else f"{self.dtype}, ") + head
        index = f"{self.index_vectors:,} x {self.index_dim} float32 vectors, flat" if self.index_bytes else "none"
        scratch = "FAISS GPU temporary memory" if self.index_scratch_bytes else ""
        rows = [
            ("card", self.gpu_bytes, self.model),
            ("weights", self.weights_bytes, weights),
            ("KV cache", self.kv_bytes, f"{seqs} x {ctx:,} tokens x {self.kv_bytes_per_token // 1024} KiB "
                                        f"({self.kv_dtype})"),
            ("prefill activations", self.activation_bytes,
             f"{f'chunks of {chunk} tokens' if chunk else 'one forward'} at {ctx:,} context, one layer at a time"),
            ("shared prefix", self.prefix_bytes, f"the runner's copy of a prompt's start (at most "
                                                 f"{SHARED_PREFIX_TOKENS:,} tokens)"),
            ("decode graph pool", self.graph_pool_bytes, f"CUDA graph of the decode step: {seqs} row(s) x "
                                                         f"{buffer_columns(ctx):,} KV columns"),
            ("index", self.index_bytes, index),
            ("index scratch", self.index_scratch_bytes, scratch),
            ("outside torch", self.outside_torch_bytes, "CUDA context, kernel images"),
            ("total", self.total_bytes, ""),
        ]
        out = [f"{k:<20} {v / GiB:6.2f} GiB  {note}".rstrip() for k, v, note in rows]
        margin = f"{abs(self.margin_bytes) / GiB:.2f} GiB"
        out.append(f"{'margin':<20} {self.margin_bytes / GiB:6.2f} GiB  "
                   + (f"fits, margin {margin}" if self.fits else f"does not fit, short by {margin}"))
        n = self.max_kv_tokens
        out.append(f"{'KV budget':<20} {n * self.kv_bytes_per_token / GiB:6.2f} GiB  {n:,} tokens: what the card "
                   f"holds beside the rest ({n // ctx} x {ctx:,})")
        return "\n".join(out)


def plan_memory(model: str, gpu_mem: int | str = 24 * GiB, quantization: str = "nf4", dtype: str = "bfloat16",
                kv_dtype: str = "bfloat16", outside_torch: int | str = OUTSIDE_TORCH, *, context: int = 8192,
                sequences: int = 1, prefill_chunk: int | str | None = 512, index_vectors: int = 0,
                index_dim: int = 0, index_scratch: int | str | None = None) -> MemoryPlan:
    """What ``sequences`` sequences of ``context`` tokens need on a card of ``gpu_mem``, line by line
    (the module's docstring), prefilled in chunks of ``prefill_chunk`` tokens (None or ``"none"``:
    in one forward), with ``index_vectors x index_dim`` float32 vectors on the card and, when there
    are any, FAISS's GPU scratch (``index_scratch``; default ``FAISS_GPU_SCRATCH``). Sizes are bytes
    or text (``"24GiB"``: ``parse_bytes``), as ``rig plan`` passes them. A plan that does not fit is
    returned too: its margin says by how much."""
    size = lambda v: parse_bytes(v) if isinstance(v, str) else v  # noqa: E731
    chunk = None if prefill_chunk in (None, "none") else int(prefill_chunk)
    if not model:
        raise ValueError("name a model: qwen2.5-32b, a Hugging Face id or a config.json path")
    if quantization not in QUANTIZATIONS or {dtype, kv_dtype} - set(DTYPE_BYTES):
        raise ValueError(f"quantization is one of {', '.join(QUANTIZATIONS)} and dtypes of {', '.join(DTYPE_BYTES)}; "
                         f"got {quantization!r}, {dtype!r}, {kv_dtype!r}")
    if context < 1 or sequences < 1 or (chunk is not None and chunk < 1):
        raise ValueError("context, sequences and the prefill chunk must be at least 1")
    name, arch = resolve_architecture(model)
    index = index_vectors * index_dim * 4
    scratch = (FAISS_GPU_SCRATCH if index_scratch is None else size(index_scratch)) if index else 0
    return MemoryPlan(
        name, quantization, dtype, kv_dtype, size(gpu_mem), weights_bytes(arch, quantization, dtype),
        prefill_activation_bytes(arch, min(chunk or context, context), context, dtype, quantization, sequences),
        decode_graph_bytes(arch, sequences, buffer_columns(context), dtype), index, scratch, size(outside_torch),
        min(context, SHARED_PREFIX_TOKENS) * arch.kv_bytes_per_token(kv_dtype),
        arch.kv_bytes_per_token(kv_dtype), sequences, context, chunk, index_vectors, index_dim)


def parse_bytes(text: str) -> int:
    """'24GB', '24GiB', '80G', '512MB' -> bytes (GB and GiB both mean 2**30: how cards are sold)."""
    t = text.strip().upper().replace("IB", "B")
    for unit, mult in (("TB", 1024**4), ("GB", GiB), ("MB", 1024**2), ("T", 1024**4), ("G", GiB), ("M", 1024**2)):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)


def kv_bytes_per_token_of(model) -> int:
    """KV bytes per token of a loaded HF model (its config and its compute dtype)."""
    from ..kernels.rope import head_dim_of

    cfg = model.config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    itemsize = 2 if dtype.itemsize < 2 else dtype.itemsize  # 4-bit weights compute in 16 bits
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim_of(cfg) * itemsize


def available_memory(device) -> int:
    """Bytes free for the KV cache now: CUDA's free memory, or the host's MemAvailable."""
    import torch

    if getattr(device, "type", device) == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * GiB


def auto_kv_budget(model, fraction: float | None = None) -> int:
    """Token slots for the KV cache: a share of the memory left after loading the model (90% of a
    GPU's free memory, a quarter of the host's available memory on CPU)."""
    device = next(model.parameters()).device
    if fraction is None:
        fraction = 0.9 if device.type == "cuda" else 0.25
    return int(available_memory(device) * fraction) // kv_bytes_per_token_of(model)
