"""Loads the optional native extension ``rig_decode._C``: C++ (and, where built, CUDA) kernels.

The extension registers the operator ``torch.ops.rig_decode.rope_shift_layers_`` (``rope.rope_shift_ref_``
on every layer of a cache, checked and prepared once) for the CPU, and for CUDA when it was built
against a CUDA torch with ``nvcc`` at hand. It is a plain torch operator library, not a Python
module: it is loaded with ``torch.ops.load_library`` from ``rig_decode/_C*.so``, once, on first use.

Build it (cmake and a C++ compiler needed; rebuild after upgrading torch) with::

    scripts/build_native.sh

``RIG_NATIVE=0`` disables loading it; without it ``kernels.rope_shift_layers_`` falls back to Triton or torch.
"""

from __future__ import annotations

import os
import sysconfig
import threading
from pathlib import Path

import torch

from .rope import check_shift_args

_PACKAGE_DIR = Path(__file__).resolve().parent.parent
_OP = "rig_decode::rope_shift_layers_"

_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet
_error = ""


def _library_path() -> Path | None:
    found = sorted(_PACKAGE_DIR.glob("_C*.so"))
    if not found:
        return None
    # Several builds may sit side by side (one per interpreter): prefer this interpreter's name.
    own = _PACKAGE_DIR / f"_C{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    return own if own in found else found[0]


def _has_kernel(dispatch_key: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(_OP, dispatch_key)
    except RuntimeError:  # the operator itself is not registered
        return False


def _load() -> tuple[bool, str]:
    if os.environ.get("RIG_NATIVE", "1") == "0":
        return False, "disabled by RIG_NATIVE=0"
    path = _library_path()
    if not _has_kernel("CPU"):  # else loaded earlier in this process (a library cannot be loaded twice)
        if path is None:
            return False, f"not built: no _C*.so in {_PACKAGE_DIR} (run scripts/build_native.sh)"
        try:
            torch.ops.load_library(str(path))
        except Exception as exc:  # noqa: BLE001 - any failure to load means "not available", with its reason
            return False, f"failed to load {path}: {type(exc).__name__}: {exc}"
        if not _has_kernel("CPU"):
            return False, f"{path} does not register {_OP} (stale build? run scripts/build_native.sh)"
    if "interleaved" not in _argument_names():
        return False, f"{path} is a stale build: its {_OP} takes no interleaved argument (run scripts/build_native.sh)"
    return True, ""


def _argument_names() -> list[str]:
    return [a.name for a in torch.ops.rig_decode.rope_shift_layers_.default._schema.arguments]


def available(reload: bool = False) -> bool:
    """Whether the extension is loaded, loading it on the first call.

    The outcome is cached; ``reload=True`` tries again (after a build, or a change of ``RIG_NATIVE``).
    """
    global _loaded, _error
    with _lock:
        if _loaded is None or reload:
            _loaded, _error = _load()
        return _loaded


def load_error() -> str:
    """Why the extension is not available ("" when it is)."""
    available()
    return _error


def supports(device: torch.device | str) -> bool:
    """Whether the extension has a kernel for tensors on ``device``."""
    if not available():
        return False
    device = torch.device(device)
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return _has_kernel("CUDA")
    return False


def rope_shift_layers_(layers: list[torch.Tensor], rows: torch.Tensor, cols: torch.Tensor, shift: torch.Tensor,
                       inv_freq: torch.Tensor, interleaved: bool = False) -> list[torch.Tensor]:
    """``rope.rope_shift_ref_`` on every layer's keys (one shape, dtype and device, no two sharing
    memory) with the same entries, by the native kernel.

    Arguments are checked in Python (``rope.check_shift_args``) before the op runs, so a bad call
    raises here and never reaches the op's own checks, which stay as a backstop for direct calls:
    on one CUDA machine (docs/kernels.md) an exception thrown inside the op ended the process
    instead of reaching Python.
    The indices go to the op as host tensors: on CUDA they reach the device through pinned memory
    with no device sync (indices given on the device cost one, to bring them to the host). The op
    computes the angles' cos / sin once for all layers. The (row, column) pairs must be distinct:
    the kernel rotates in place, so a repeated pair would be rotated by both shifts (or raced over
    by two threads) where the reference keeps one of them.
    """
    if not available():
        raise RuntimeError(f"the native extension rig_decode._C is not available: {load_error()}")
    rows, cols = rows.cpu(), cols.cpu()
    if layers and layers[0].device.type == "cpu":  # a CUDA tensor among them would pick the CUDA kernel
        shift, inv_freq = shift.cpu(), inv_freq.cpu()
    check_shift_args(layers, rows, cols, shift, inv_freq)
    torch.ops.rig_decode.rope_shift_layers_(layers, rows, cols, shift, inv_freq, interleaved)
    torch.autograd.graph.increment_version(layers)  # written through raw pointers: tell autograd
    return layers


def rope_shift_(keys: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, shift: torch.Tensor,
                inv_freq: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """``rope_shift_layers_`` on one tensor of keys."""
    return rope_shift_layers_([keys], rows, cols, shift, inv_freq, interleaved)[0]
