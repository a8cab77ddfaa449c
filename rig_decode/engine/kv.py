"""KV-cache memory: the planner behind ``rig plan`` and the token budget the scheduler admits by.

Weights: every linear layer of the decoder in the chosen format; embeddings, norms and the LM head
stay in the compute dtype (bitsandbytes does not quantize them). NF4 with double quantisation
costs 4 bits per weight plus one 8-bit absmax per 64 weights plus one fp32 scale per 256 absmax
values: 4 + 8/64 + 32/(64*256) = 4.127 bits.

KV: ``2 (K and V) x layers x kv_heads x head_dim x bytes`` per token, e.g. Qwen2.5-32B in bf16:
2 x 64 x 8 x 128 x 2 B = 256 KiB per token.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

GiB = 1024**3
NF4_BITS = 4 + 8 / 64 + 32 / (64 * 256)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}

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
    def linear_params(self) -> int:
        """Weights of the decoder's linear layers (what 4-bit quantisation applies to)."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        mlp = 3 * h * self.intermediate_size
        return self.num_hidden_layers * (attn + mlp)

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


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    model: str
    quantization: str
    kv_dtype: str
    gpu_bytes: int
    weights_bytes: int
    overhead_bytes: int
    kv_bytes_per_token: int
    max_kv_tokens: int

    @property
    def kv_bytes(self) -> int:
        return self.max_kv_tokens * self.kv_bytes_per_token

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        rows = [
            ("model", self.model),
            ("weights", f"{self.weights_bytes / GiB:.2f} GiB ({self.quantization})"),
            ("runtime overhead", f"{self.overhead_bytes / GiB:.2f} GiB"),
            ("KV cache per token", f"{self.kv_bytes_per_token / 1024:.0f} KiB ({self.kv_dtype})"),
            ("memory", f"{self.gpu_bytes / GiB:.2f} GiB"),
            ("KV budget", f"{self.kv_bytes / GiB:.2f} GiB = {self.max_kv_tokens:,} tokens"),
            ("e.g.", f"{self.max_kv_tokens // 4096} sequences of 4k tokens, {self.max_kv_tokens // 8192} of 8k"),
        ]
        return "\n".join(f"{k:<20} {v}" for k, v in rows)


def plan_memory(model: str, gpu_bytes: int, quantization: str = "nf4", dtype: str = "bfloat16",
                kv_dtype: str = "bfloat16", overhead_bytes: int = int(1.5 * GiB)) -> MemoryPlan:
    """What fits: weights in ``quantization``, ``overhead_bytes`` for the CUDA context, activations
    and allocator slack, and the rest as KV cache."""
    name, arch = resolve_architecture(model)
    linear_bits = NF4_BITS if quantization == "nf4" else 8 * DTYPE_BYTES[dtype]
    weights = int(arch.linear_params * linear_bits / 8 + arch.other_params * DTYPE_BYTES[dtype])
    per_token = arch.kv_bytes_per_token(kv_dtype)
    free = gpu_bytes - weights - overhead_bytes
    if free <= 0:
        raise ValueError(f"{name} needs {weights / GiB:.1f} GiB of weights plus {overhead_bytes / GiB:.1f} GiB "
                         f"overhead: it does not fit in {gpu_bytes / GiB:.1f} GiB")
    return MemoryPlan(name, quantization, kv_dtype, gpu_bytes, weights, overhead_bytes, per_token, free // per_token)


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
