"""Kernels for KV surgery at hop time, each with a plain-torch reference that is the CPU path.

``rope_shift_`` (re-rotate cached keys to new positions) dispatches to, in order of preference:

* ``native``: the optional C++/CUDA extension ``rig_decode._C`` built by the top-level
  ``CMakeLists.txt`` (``kernels/native.py`` loads it when present);
* ``triton``: ``triton_rope.py``, on CUDA tensors when Triton imports;
* ``torch``: ``rope.py``, everywhere.

``RIG_KERNELS=torch|triton|native`` forces one (an error names what is missing, or what the
device lacks); the default is ``auto``. Triton on CPU tensors runs only under
``TRITON_INTERPRET=1`` (tests), never by ``auto``.
"""

from __future__ import annotations

import os

import torch

from . import native
from .rope import _check, rope_shift_ref_, rotary_inv_freq

__all__ = ["rope_shift_", "rope_shift_layers_", "rope_shift_ref_", "rotary_inv_freq", "backend_for", "has_triton"]


def has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def backend_for(device: torch.device) -> str:
    """The backend ``rope_shift_`` uses for tensors on ``device``."""
    forced = os.environ.get("RIG_KERNELS", "auto")
    if forced not in ("auto", "torch", "triton", "native"):
        raise ValueError(f"RIG_KERNELS must be auto, torch, triton or native, got {forced!r}")
    device = torch.device(device)
    if forced == "native" and not native.available():
        raise RuntimeError(f"RIG_KERNELS=native but the native extension is not built ({native.load_error()})")
    if forced == "native" and not native.supports(device):
        raise RuntimeError(f"RIG_KERNELS=native but the native extension has no {device.type} kernel "
                           "(built without CUDA: rebuild with nvcc and a CUDA build of torch)")
    if forced == "triton" and not has_triton():
        raise RuntimeError("RIG_KERNELS=triton but triton is not installed (pip install rig_decode[gpu])")
    if forced == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("RIG_KERNELS=triton on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")
    if forced != "auto":
        return forced
    if native.available() and native.supports(device):
        return "native"
    if device.type == "cuda" and has_triton():
        return "triton"
    return "torch"


def rope_shift_(keys: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, shift: torch.Tensor,
                inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``keys[rows[n], :, cols[n], :]`` by ``shift[n]`` positions in place (see ``rope.py``);
    the (row, column) pairs must be distinct."""
    return rope_shift_layers_([keys], rows, cols, shift, inv_freq)[0]


def rope_shift_layers_(layers: list[torch.Tensor], rows: torch.Tensor, cols: torch.Tensor, shift: torch.Tensor,
                       inv_freq: torch.Tensor) -> list[torch.Tensor]:
    """``rope_shift_`` on every layer's keys (one shape) with the same entries: the arguments are
    checked here once, not once per layer (the index bounds cost a device sync on CUDA). The native
    op, callable on its own, checks its indices again at each call: one small sync per layer on
    CUDA (tens of microseconds for a 64-layer model, beside a hop's forward of tens of ms)."""
    if not layers:
        return layers
    _check(layers[0], rows, cols, shift, inv_freq)
    for keys in layers[1:]:
        if keys.shape != layers[0].shape:
            raise ValueError(f"every layer's keys must have one shape, got {tuple(layers[0].shape)} and "
                             f"{tuple(keys.shape)}")
    rows, cols = rows.long(), cols.long()
    backend = backend_for(layers[0].device)
    if backend == "native":
        kernel = native.rope_shift_
    elif backend == "triton":
        from .triton_rope import rope_shift_triton_ as kernel
    else:
        kernel = rope_shift_ref_
    for keys in layers:
        kernel(keys, rows, cols, shift, inv_freq)
    return layers
