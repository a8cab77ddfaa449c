"""The Triton version of ``rope.rope_shift_ref_``: one program per (entry, head), in place.

Each program loads the two halves of one key vector through the tensor's own strides (so a
non-contiguous cache view works), rotates them in fp32 and stores them back in the key dtype. Runs on
CUDA, and on CPU under ``TRITON_INTERPRET=1`` (how the tests check it against the reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_shift_kernel(k_ptr, rows_ptr, cols_ptr, shift_ptr, freq_ptr,
                       stride_b, stride_h, stride_c, stride_d,
                       HALF: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(rows_ptr + n)
    col = tl.load(cols_ptr + n)
    shift = tl.load(shift_ptr + n).to(tl.float32)
    i = tl.arange(0, BLOCK)
    ok = i < HALF
    base = k_ptr + row * stride_b + h * stride_h + col * stride_c
    k1 = tl.load(base + i * stride_d, mask=ok, other=0.0)
    k2 = tl.load(base + (i + HALF) * stride_d, mask=ok, other=0.0)
    angle = shift * tl.load(freq_ptr + i, mask=ok, other=0.0)
    c, s = tl.cos(angle), tl.sin(angle)
    a, b = k1.to(tl.float32), k2.to(tl.float32)
    tl.store(base + i * stride_d, (a * c - b * s).to(k1.dtype), mask=ok)
    tl.store(base + (i + HALF) * stride_d, (b * c + a * s).to(k1.dtype), mask=ok)


def rope_shift_triton_(keys: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, shift: torch.Tensor,
                       inv_freq: torch.Tensor) -> torch.Tensor:
    """Same contract as ``rope.rope_shift_ref_`` (checked by the caller, ``kernels.rope_shift_layers_``)."""
    n = rows.numel()
    if n == 0:
        return keys
    half = keys.shape[-1] // 2
    dev = keys.device
    _rope_shift_kernel[(n, keys.shape[1])](
        keys, rows.to(dev, torch.int64).contiguous(), cols.to(dev, torch.int64).contiguous(),
        shift.to(dev, torch.float32).contiguous(), inv_freq.to(dev, torch.float32).contiguous(),
        *keys.stride(), HALF=half, BLOCK=triton.next_power_of_2(half))
    return keys
