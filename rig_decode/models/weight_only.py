"""Weight-only quantized linear layers through PyTorch's own kernels: int8 per channel, int4 per group.

A decode step reads every weight once per token, so its speed is the weight bytes over the memory
bandwidth. ``quantization: int8`` stores each linear weight as int8 with one scale per output
channel and multiplies through ``aten._weight_int8pack_mm`` (CPU, CUDA); ``int4`` stores 4 bits
with a scale and a zero point per group of ``INT4_GROUP`` input channels (4.25 bits a weight, less
than nf4's 4.127 + the LM head) through ``aten._weight_int4pack_mm`` (CUDA, the "tinygemm" kernel
gpt-fast uses) or ``aten._weight_int4pack_mm_for_cpu``. Both are single aten calls, so they sit
inside a compiled graph (``decode_graph.py``) with nothing around them. torchao wraps the same
kernels in tensor subclasses; this module is the few lines they need here, with no version pin
between torchao and torch.

The kernels take bf16 activations (their fast path on CPU as on CUDA); a layer casts its input to
bf16 and its output back to the model's dtype, so an fp32 model keeps fp32 norms, residuals and
logits around the quantized matmuls. Weights are quantized once at load (round to nearest), the
LM head included; embeddings and norms stay as they are. Inference only.
"""

from __future__ import annotations

import torch
from torch import nn

INT4_GROUP = 128
QUANTIZATIONS = ("int8", "int4")


class Int8Linear(nn.Module):
    """``y = (x @ W_int8^T) * scale + bias``: int8 weights, one bf16 scale per output channel."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.register_buffer("weight", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.weight, self.scale)
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int4Linear(nn.Module):
    """4-bit weights, asymmetric per group of ``INT4_GROUP`` input channels (bf16 scale and zero),
    packed for torch's int4 weight-only matmul on the weight's device."""

    def __init__(self, linear: nn.Linear, group: int = INT4_GROUP):
        super().__init__()
        n, k = linear.out_features, linear.in_features
        while k % group:  # the widest power-of-two group that divides the input width
            group //= 2
        if group < 32:
            raise ValueError(f"int4 needs an input width divisible by 32, got {k}")
        w = linear.weight.detach().float().view(n, k // group, group)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        q = ((w - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
        zero = lo + 8 * scale  # the kernels compute (q - 8) * scale + zero
        self.cpu = linear.weight.device.type == "cpu"
        if self.cpu:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8)
        self.register_buffer("weight", packed)
        self.register_buffer("scale_zero", torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
                             .to(torch.bfloat16))
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.group, self.in_features, self.out_features = group, k, n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        if self.cpu:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.weight, self.group, self.scale_zero)
        else:
            y = torch.ops.aten._weight_int4pack_mm(flat, self.weight, self.group, self.scale_zero)
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}, "
                f"bias={self.bias is not None}")


def int4_fits(linear: nn.Linear) -> bool:
    """Whether torch's int4 packing takes this layer: outputs a multiple of 16, inputs of 32 (a
    vocabulary resized for added tokens may not be: that head stays as it is)."""
    return linear.out_features % 16 == 0 and linear.in_features % 32 == 0


def quantize_linears(model: nn.Module, bits: str) -> int:
    """Replace every plain ``nn.Linear`` of ``model`` (the LM head included) by its ``bits``
    (``int8`` or ``int4``) weight-only version, in place; returns how many. An LM head that shares
    its weight with the embeddings gets a quantized copy; the embeddings stay."""
    if bits not in QUANTIZATIONS:
        raise ValueError(f"weight-only quantization is one of {QUANTIZATIONS}, got {bits!r}")
    cls = Int8Linear if bits == "int8" else Int4Linear
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and (bits == "int8" or int4_fits(child)):
                setattr(parent, name, cls(child))
                count += 1
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if getattr(model.config, "tie_word_embeddings", False) and not isinstance(head, nn.Linear):
        model.config.tie_word_embeddings = False  # the head is its own (quantized) tensor now
    return count
