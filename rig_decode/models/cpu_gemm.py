"""Pre-packed linear layers for fp32 inference on CPU.

A decode step is a stack of skinny GEMMs: one row per sequence times a weight matrix. On CPU,
``F.linear`` hands them to MKL's sgemm, whose small-M path is poor: a 576x49152 head costs 2.5-3x
as much for 8 rows as for 1, although the weights (read once) dominate either way. oneDNN's inner
product over a weight pre-packed into its blocked layout costs ~1.5x as much for 8 rows as for 1 and is
faster at any M (``bench/decode_step.py`` measures both side by side). It is also batch invariant:
a row's output does not depend on which other rows share the call - the property continuous
batching needs for a request to decode the same tokens alone or in a crowd.

The packed weight is an opaque oneDNN tensor with no autograd and no place in the state dict, so
packing is for inference only: ``load_model`` packs (``model.cpu_gemm``); training, or saving the
weights, loads with ``cpu_gemm: torch``.
"""

from __future__ import annotations

import torch
from torch import nn


def packing_available() -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """``nn.Linear`` (inference, CPU, fp32) with its weight in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear, batch_hint: int = 8):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("PackedLinear is inference-only: load the model with model.cpu_gemm: torch to train")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module, batch_hint: int = 8) -> int:
    """Replace every plain fp32 CPU ``nn.Linear`` in ``model`` by a ``PackedLinear``, in place;
    returns how many. Subclasses (bitsandbytes' ``Linear4bit``, peft's LoRA layers) are left alone."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is nn.Linear and child.weight.device.type == "cpu"
                    and child.weight.dtype == torch.float32):
                setattr(parent, name, PackedLinear(child, batch_hint))
                count += 1
    return count
