"""The CUDA kernels compile for the GPUs they target, on a machine without nvcc or a GPU.

``scripts/check_cuda.sh`` compiles ``rig_decode/kernels/csrc/*.cu`` with clang and NVIDIA's ptxas
(headers and ptxas from PyPI wheels). Skipped only where that toolchain is missing: no clang 17 or
newer, or PyPI out of reach (``scripts/test.sh`` installs Debian's clang-19 where it can).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EM_CUDA = 190  # ELF e_machine of an NVIDIA GPU binary
ARCHS = {"sm_80": 80, "sm_90": 90}


def test_the_cuda_kernels_compile_for_ampere_and_hopper():
    proc = subprocess.run(["bash", "scripts/check_cuda.sh"], cwd=ROOT, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "PYTHON": sys.executable, "CUDA_ARCHS": " ".join(ARCHS)})
    if proc.returncode == 2:
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, f"scripts/check_cuda.sh failed:\n{proc.stdout}\n{proc.stderr}"
    out = ROOT / "build" / "cuda-check"
    for source in sorted((ROOT / "rig_decode" / "kernels" / "csrc").glob("*.cu")):
        for arch, number in ARCHS.items():
            cubin = (out / f"{source.stem}.{arch}.cubin").read_bytes()
            assert cubin[:4] == b"\x7fELF" and int.from_bytes(cubin[18:20], "little") == EM_CUDA, arch
            # The architecture is in the low byte of e_flags (ELF64: offset 48).
            assert int.from_bytes(cubin[48:52], "little") & 0xFF == number, arch
        host = (out / f"{source.stem}.host.o").read_bytes()
        # Both operators get a CUDA kernel: their names are registered with the dispatcher.
        for op in (b"rope_shift_", b"rope_shift_layers_"):
            assert op + b"\0" in host, op
