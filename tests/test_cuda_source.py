"""The CUDA kernels compile for the GPUs they target, on a machine without a CUDA toolkit or a GPU.

* native: ``scripts/check_cuda.sh`` compiles ``kernels/*.cu`` with NVIDIA's nvcc
  13.0 from PyPI wheels (the CUDA of current torch CUDA builds), warnings as errors. Skipped only where PyPI is
  out of reach or there is no host compiler.
* Triton: the kernel the CPU tests run in Triton's interpreter is compiled ahead of time for
  sm_80 / sm_90 by Triton's own compiler (Triton ships its ptxas): the interpreter accepts programs
  the compiler would reject.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EM_CUDA = 190  # ELF e_machine of an NVIDIA GPU binary


def test_the_cuda_kernels_compile_for_ampere_and_hopper():
    proc = subprocess.run(["bash", "scripts/check_cuda.sh"], cwd=ROOT, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "PYTHON": sys.executable})
    if proc.returncode == 2:
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, f"scripts/check_cuda.sh failed:\n{proc.stdout}\n{proc.stderr}"
    out = ROOT / "build" / "cuda-check"
    for source in sorted((ROOT / "kernels").glob("*.cu")):
        for arch in (80, 90):
            assert f".target sm_{arch}" in (out / f"{source.stem}.sm_{arch}.ptx").read_text()
            cubin = (out / f"{source.stem}.sm_{arch}.cubin").read_bytes()
            assert cubin[:4] == b"\x7fELF" and int.from_bytes(cubin[18:20], "little") == EM_CUDA, arch
            # CUDA 13's ptxas writes the architecture into bits 8-15 of e_flags (ELF64: offset 48).
            assert int.from_bytes(cubin[48:52], "little") >> 8 & 0xFF == arch
        # The operator gets its CUDA kernel: the object registers it with the dispatcher by name.
        assert b"rope_shift_layers_\0" in (out / f"{source.stem}.o").read_bytes()


@pytest.mark.parametrize("arch,dtype,half", [(80, "bf16", 64), (90, "bf16", 64), (80, "fp16", 32), (90, "fp32", 3)])
def test_the_triton_kernel_compiles_for_ampere_and_hopper(arch, dtype, half):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from rig_decode.kernels.triton_rope import _rope_shift_kernel

    # Under TRITON_INTERPRET=1 (set by the CPU tests) the decorator made an interpreted function:
    # compile the same Python function.
    kernel = JITFunction(_rope_shift_kernel.fn)
    signature = {"table_ptr": "*i64", "k_ptr": f"*{dtype}", "rows_ptr": "*i64", "cols_ptr": "*i64", "shift_ptr": "*fp32",
                 "freq_ptr": "*fp32", "stride_b": "i64", "stride_h": "i64", "stride_c": "i64", "step": "i64", "pair": "i64",
                 "HALF": "constexpr", "BLOCK": "constexpr"}
    source = ASTSource(kernel, signature, constexprs={"HALF": half, "BLOCK": triton.next_power_of_2(half)})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32))
    assert f".target sm_{arch}" in compiled.asm["ptx"]
    cubin = compiled.asm["cubin"]
    assert cubin[:4] == b"\x7fELF" and int.from_bytes(cubin[18:20], "little") == EM_CUDA
