"""Kernels for KV surgery at hop time, each with a plain-torch reference that is the CPU path.

``rope_shift_`` (re-rotate cached keys to new positions) and ``rope_shift_layers_`` (the same in
every layer of a cache, prepared once) dispatch to, in order of preference:

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
from .rope import RopeSpec, check_shift_args, rope_of, rope_shift_ref_, rotate_unchecked_
from .transfer import to_device

__all__ = ["RopeSpec", "rope_shift_", "rope_shift_layers_", "rope_shift_ref_", "rope_of", "backend_for", "has_triton",
           "to_device"]


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
                inv_freq: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate ``keys[rows[n], :, cols[n], :]`` by ``shift[n]`` positions in place (see ``rope.py``);
    the (row, column) pairs must be distinct. ``interleaved``: the rotated pairs of dimensions are
    ``(2i, 2i + 1)``, not ``(i, i + head_dim/2)``."""
    return rope_shift_layers_([keys], rows, cols, shift, inv_freq, interleaved)[0]


def rope_shift_layers_(layers: list[torch.Tensor], rows: torch.Tensor, cols: torch.Tensor, shift: torch.Tensor,
                       inv_freq: torch.Tensor, interleaved: bool = False) -> list[torch.Tensor]:
    """``rope_shift_`` on every layer's keys (one shape, dtype and device, no two sharing memory)
    with the same entries, checked once for all layers before anything is written.

    For CUDA keys, give the indices as CPU tensors where they are built on the host (the runner
    does): their bounds are then checked there, and they reach the device in one copy that does
    not wait for the GPU, so the re-rotation costs no device sync. Indices already on the device
    cost one, for the bounds check."""
    if not layers:
        return layers
    rows, cols = rows.long(), cols.long()
    first = layers[0]
    backend = backend_for(first.device)
    if backend == "native":  # checks everything itself, and computes the angles once
        return native.rope_shift_layers_(layers, rows, cols, shift, inv_freq, interleaved)
    check_shift_args(layers, rows, cols, shift, inv_freq)
    rows, cols, shift, inv_freq = (to_device(t, first.device) for t in (rows, cols, shift, inv_freq))
    if backend == "torch":
        for keys in layers:
            rotate_unchecked_(keys, rows, cols, shift, inv_freq, interleaved)
        return layers
    from .triton_rope import rope_shift_layers_triton_

    return rope_shift_layers_triton_(layers, rows, cols, shift, inv_freq, interleaved)
