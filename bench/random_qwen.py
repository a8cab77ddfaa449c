"""A Qwen2-architecture model from its config alone, random weights, optionally nf4 (bench/gpu.py).

The architecture is created on the meta device and each decoder layer then gets random weights on
the target device, quantised to nf4 (bitsandbytes ``Linear4bit``) before the next layer's weights
exist: a 32B model's 64 GB of bf16 weights never exist at once.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding


def qwen2_config(shape: dict) -> Qwen2Config:
    return Qwen2Config(**shape, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                       tie_word_embeddings=False)


def _randn(shape, device, dtype, gen, std: float = 0.02) -> torch.Tensor:
    return torch.randn(shape, device=device, dtype=dtype, generator=gen).mul_(std)


def _random_linear(meta: nn.Linear, device, dtype, quant, gen) -> nn.Module:
    """A linear layer shaped like ``meta`` with random weights, quantised as ``quant`` (a
    ``BitsAndBytesConfig``) says when given."""
    weight = _randn((meta.out_features, meta.in_features), device, dtype, gen)
    bias = None if meta.bias is None else _randn((meta.out_features,), device, dtype, gen)
    if quant is not None:
        import bitsandbytes as bnb

        how = dict(compress_statistics=quant.bnb_4bit_use_double_quant, quant_type=quant.bnb_4bit_quant_type)
        layer = bnb.nn.Linear4bit(meta.in_features, meta.out_features, bias=bias is not None,
                                  compute_dtype=quant.bnb_4bit_compute_dtype, device="meta", **how)
        layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, module=layer, **how)
    else:
        layer = nn.Linear(meta.in_features, meta.out_features, bias=bias is not None, device="meta")
        layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    # Moving a Params4bit quantises it; the bf16 weight is freed when `weight` goes out of scope.
    return layer.to(device)


def _materialise_layer(layer: nn.Module, device, dtype, quant, gen) -> None:
    linears = [(parent, name, child) for parent in layer.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in linears:
        setattr(parent, name, _random_linear(child, device, dtype, quant, gen))
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        norm.weight = nn.Parameter(torch.ones(norm.weight.shape, device=device, dtype=dtype), requires_grad=False)


@torch.no_grad()
def build_model(shape: dict, device: torch.device, dtype: torch.dtype, quant=None, seed: int = 0) -> Qwen2ForCausalLM:
    """The architecture on the meta device, then filled one decoder layer at a time, so at most one
    layer's full-precision weights exist at any moment."""
    config = qwen2_config(shape)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    gen = torch.Generator(device=device).manual_seed(seed)
    inner = model.model
    inner.embed_tokens.weight = nn.Parameter(_randn(inner.embed_tokens.weight.shape, device, dtype, gen),
                                             requires_grad=False)
    model.lm_head.weight = nn.Parameter(_randn(model.lm_head.weight.shape, device, dtype, gen), requires_grad=False)
    inner.norm.weight = nn.Parameter(torch.ones(inner.norm.weight.shape, device=device, dtype=dtype),
                                     requires_grad=False)
    for layer in inner.layers:
        _materialise_layer(layer, device, dtype, quant, gen)
    inner.rotary_emb = Qwen2RotaryEmbedding(config).to(device)  # its inv_freq was computed on meta
    left = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left on the meta device: {', '.join(left[:5])}")
    return model.eval()


def weights_bytes(model: nn.Module) -> int:
    """Parameters and buffers, plus the nf4 scales bitsandbytes keeps beside each packed weight."""
    total = sum(t.nbytes for t in itertools.chain(model.parameters(), model.buffers()))
    for module in model.modules():
        qs = getattr(getattr(module, "weight", None), "quant_state", None)
        if qs is not None:
            total += qs.absmax.nbytes + qs.code.nbytes
            if qs.nested:
                total += qs.state2.absmax.nbytes + qs.state2.code.nbytes
    return total
