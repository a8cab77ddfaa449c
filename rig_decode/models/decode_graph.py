"""A decode step that compiles to one graph: one token per row, over the runner's KV buffers.

A decode step through the HF modules is eager Python: per layer a dozen module calls, the cache's
``update``, the mask builder and the packed-attention dispatch, at batch 1 a large share of the
step on CPU and nearly all of it on a GPU. ``DecodeGraph`` is that step written once as a plain
function of tensors (as gpt-fast and nano-vllm write theirs): token ids, positions, the column each
row writes and which columns each row attends to go in as tensors; the per-layer key and value
buffers (``BufferedLayer``'s, spare rows and columns included) are written in place at those
columns; the logits come out. Nothing in it depends on Python values that change from step to
step, so ``torch.compile(fullgraph=True)`` takes it whole, and on CUDA ``mode="reduce-overhead"``
replays it as a CUDA graph (one per buffer shape: buffers grow in steps of a quarter, so there are
few). Splices, prefill and every re-layout stay outside, in the runner (STYLE.md, lesson 2).

It calls the model's own modules (its linear layers, whatever their weight format: plain, oneDNN
packed, int8/int4 weight-only; its norms and MLP), so it computes what the HF forward computes;
only the rotary embedding and attention are written out. It serves Llama-shaped decoders (Llama,
Qwen2, Qwen3, Mistral without a sliding window, SmolLM): ``unsupported_reason`` names what keeps
another model on the eager path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cpu_gemm import PackedLinear
from .weight_only import Int4Linear, Int8Linear

DECODE_STEPS = ("auto", "hf", "graph", "compiled")
STATIC_ROPE = ("default", "linear", "llama3", "yarn", "longrope")  # inv_freq fixed at load time
# Architectures whose decoder layer is exactly what ``_step`` computes (no multipliers, every layer
# rotated, rotary pairs (i, i + dim/2)); others keep the HF path.
MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def unsupported_reason(model) -> str | None:
    """Why ``DecodeGraph`` cannot run this model (None: it can)."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TYPES:
        return f"model type {model_type!r} is not one of {', '.join(MODEL_TYPES)}"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "embed_tokens") or not hasattr(inner, "norm"):
        return f"{type(model).__name__} is not a decoder with model.layers, embed_tokens and norm"
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp",
                 "input_layernorm", "post_attention_layernorm"):
        if not all(_has(layer, name) for layer in layers):
            return f"a decoder layer has no {name}"
    rope = getattr(inner, "rotary_emb", None)
    if rope is None or getattr(rope, "rope_type", "default") not in STATIC_ROPE:
        return f"rotary embedding {getattr(rope, 'rope_type', None)!r} is not computed once at load time"
    if getattr(model.config, "sliding_window", None) and getattr(model.config, "use_sliding_window", True):
        if any(t != "full_attention" for t in getattr(model.config, "layer_types", None) or ["sliding"]):
            return "sliding-window attention"
    head_dim = _head_dim(model.config)
    if rope.inv_freq.numel() * 2 != head_dim:
        return "partial rotary embedding"
    return None


def decode_step_for(model, choice: str) -> str:
    """The decode step a runner uses for ``choice`` (one of ``DECODE_STEPS``). ``auto``: ``compiled``
    on CUDA and for weight-only quantized models on CPU (where the compiled step measures faster:
    docs/performance.md), else ``hf``, and ``hf`` for a model the graph cannot run or compile;
    ``graph`` or ``compiled`` asked for by name for such a model is an error that says why."""
    if choice not in DECODE_STEPS:
        raise ValueError(f"decode_step must be {', '.join(DECODE_STEPS[:-1])} or {DECODE_STEPS[-1]}, got {choice!r}")
    reason = unsupported_reason(model)
    if choice == "compiled" and reason is None:
        reason = uncompilable_reason(model)
    if choice in ("graph", "compiled") and reason is not None:
        raise ValueError(f"decode_step {choice}: {reason}")
    if choice != "auto":
        return choice
    if reason is not None or uncompilable_reason(model) is not None:
        return "hf"
    device = next(model.parameters()).device
    quantized = any(isinstance(m, (Int8Linear, Int4Linear)) for m in model.modules())
    return "compiled" if device.type == "cuda" or quantized else "hf"


def uncompilable_reason(model) -> str | None:
    """Why torch.compile cannot trace this model's decode step (None: it can)."""
    if any(isinstance(m, PackedLinear) for m in model.modules()):
        return "its linear weights are packed for oneDNN (opaque to torch.compile): load it with model.cpu_gemm: torch"
    return None


def _has(module, dotted: str) -> bool:
    for part in dotted.split("."):
        module = getattr(module, part, None)
        if module is None:
            return False
    return True


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecodeGraph:
    """``step(ids, positions, columns, mask, keys, values) -> logits``: one token per row.

    ``ids``, ``positions``, ``columns``: ``[R]`` (long); ``mask``: ``[R, C]`` bool, the columns each
    row attends to (its new one included); ``keys``/``values``: per layer ``[R, kv_heads, C, dim]``,
    written at ``[r, :, columns[r]]``. ``R`` and ``C`` are the buffers' rows and columns: the
    caller pads the batch to the buffers' rows, so a shape changes only when a buffer does.
    Returns fp32 logits ``[R, vocab]``.

    ``compile``: ``torch.compile(fullgraph=True)`` (a graph break is an error), with CUDA graphs on
    CUDA; off: the same function eagerly (a reference, and for models torch cannot compile)."""

    def __init__(self, model, compile: bool = True, backend: str = "inductor"):
        reason = unsupported_reason(model)
        if reason is None and compile:
            reason = uncompilable_reason(model)
        if reason is not None:
            raise ValueError(f"no {'compiled ' if compile else ''}decode step for this model: {reason}")
        cfg = model.config
        self.model, self.inner = model, model.model
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, _head_dim(cfg)
        self.gqa = self.heads != self.kv_heads
        rope = self.inner.rotary_emb
        self.inv_freq = rope.inv_freq.float()
        self.rope_scale = float(getattr(rope, "attention_scaling", 1.0))
        self.scaling = self.head_dim**-0.5
        self.compiled = compile
        if compile:
            # Every instance compiles the one function ``_step``, and Dynamo counts recompiles per
            # function: leave room for many models (and their buffer shapes) in one process.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            # Shapes are the buffers' (they change when a buffer grows): the first compile is for
            # the shapes it meets, the second for any (torch.compile's automatic dynamic shapes).
            cuda = next(model.parameters()).device.type == "cuda"
            self._fn = torch.compile(self._step, fullgraph=True, backend=backend,
                                     mode="reduce-overhead" if cuda and backend == "inductor" else None)
        else:
            self._fn = self._step

    @torch.no_grad()
    def __call__(self, ids, positions, columns, mask, keys, values) -> torch.Tensor:
        return self._fn(ids, positions, columns, mask, keys, values)

    def _step(self, ids, positions, columns, mask, keys, values):
        inner = self.inner
        x = inner.embed_tokens(ids)  # [R, hidden]
        rows = x.shape[0]
        freqs = positions[:, None].float() * self.inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scale).to(x.dtype)[:, None]  # [R, 1, dim]
        sin = (emb.sin() * self.rope_scale).to(x.dtype)[:, None]
        row_index = torch.arange(rows, device=x.device)
        attend = mask[:, None, None, :]  # [R, 1, 1, C]
        for layer, k_buf, v_buf in zip(inner.layers, keys, values):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(rows, self.heads, self.head_dim)
            k = attn.k_proj(h).view(rows, self.kv_heads, self.head_dim)
            v = attn.v_proj(h).view(rows, self.kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3: per-head norms before the rotation
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k_buf[row_index, :, columns] = k.to(k_buf.dtype)
            v_buf[row_index, :, columns] = v.to(v_buf.dtype)
            o = F.scaled_dot_product_attention(q[:, :, None].to(k_buf.dtype), k_buf, v_buf, attn_mask=attend,
                                               scale=self.scaling, enable_gqa=self.gqa)
            x = x + attn.o_proj(o.reshape(rows, self.heads * self.head_dim).to(x.dtype))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(inner.norm(x)).float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
