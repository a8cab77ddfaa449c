"""The Triton version of ``rope.rope_shift_ref_``, for every layer of a cache in one launch, in place.

One program per (entry, head, layer). The layers are separate tensors of one shape, dtype and
strides: the kernel takes a table of their addresses (int64) and casts the layer's entry to a
pointer of the keys' type, as Triton's grouped GEMM takes its groups. Each program loads the two
halves of one key vector through the strides (so a non-contiguous cache view works), rotates them
in fp32 and stores them back in the key dtype. Runs on CUDA, and on CPU under
``TRITON_INTERPRET=1`` (how the tests check it against the reference).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .transfer import to_device


@triton.jit
def _rope_shift_kernel(table_ptr, k_ptr, rows_ptr, cols_ptr, shift_ptr, freq_ptr,
                       stride_b, stride_h, stride_c, step, pair,
                       HALF: tl.constexpr, BLOCK: tl.constexpr):
    # Pair i is (base + i * step, base + i * step + pair): (i, i + HALF) or, interleaved, (2i, 2i + 1).
    n = tl.program_id(0)
    h = tl.program_id(1)
    keys = tl.load(table_ptr + tl.program_id(2)).to(k_ptr.dtype)  # this layer's keys (k_ptr: the type)
    row = tl.load(rows_ptr + n)
    col = tl.load(cols_ptr + n)
    shift = tl.load(shift_ptr + n).to(tl.float32)
    i = tl.arange(0, BLOCK)
    ok = i < HALF
    base = keys + row * stride_b + h * stride_h + col * stride_c
    k1 = tl.load(base + i * step, mask=ok, other=0.0)
    k2 = tl.load(base + i * step + pair, mask=ok, other=0.0)
    angle = shift * tl.load(freq_ptr + i, mask=ok, other=0.0)
    c, s = tl.cos(angle), tl.sin(angle)
    a, b = k1.to(tl.float32), k2.to(tl.float32)
    tl.store(base + i * step, (a * c - b * s).to(k1.dtype), mask=ok)
    tl.store(base + i * step + pair, (b * c + a * s).to(k1.dtype), mask=ok)


def rope_shift_layers_triton_(layers: list[torch.Tensor], rows: torch.Tensor, cols: torch.Tensor,
                              shift: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool = False
                              ) -> list[torch.Tensor]:
    """``rope.rope_shift_ref_`` on every layer's keys (checked by the caller,
    ``kernels.rope_shift_layers_``): one launch per set of layers with the same strides (one,
    for a cache whose layers are laid out alike)."""
    n = rows.numel()
    if n == 0 or not layers:
        return layers
    first = layers[0]
    dev = first.device
    args = (rows.to(dev, torch.int64).contiguous(), cols.to(dev, torch.int64).contiguous(),
            shift.to(dev, torch.float32).contiguous(), inv_freq.to(dev, torch.float32).contiguous())
    half = first.shape[-1] // 2
    by_stride: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for keys in layers:
        by_stride.setdefault(keys.stride(), []).append(keys)
    # Triton launches on the current device's stream: make that the keys' device, as the native op does.
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        for (stride_b, stride_h, stride_c, stride_d), group in by_stride.items():
            step, pair = (2 * stride_d, stride_d) if interleaved else (stride_d, half * stride_d)
            table = to_device(torch.tensor([k.data_ptr() for k in group], dtype=torch.int64), dev)
            _rope_shift_kernel[(n, first.shape[1], len(group))](
                table, group[0], *args, stride_b, stride_h, stride_c, step, pair,
                HALF=half, BLOCK=triton.next_power_of_2(half))
    torch.autograd.graph.increment_version(layers)  # written through raw pointers: tell autograd
    return layers


def rope_shift_triton_(keys: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, shift: torch.Tensor,
                       inv_freq: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """``rope_shift_layers_triton_`` on one tensor of keys."""
    return rope_shift_layers_triton_([keys], rows, cols, shift, inv_freq, interleaved)[0]
