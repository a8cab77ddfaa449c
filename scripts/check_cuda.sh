#!/usr/bin/env bash
# Compile the CUDA kernels (kernels/*.cu) on a machine without a CUDA toolkit or a
# GPU, so that a compile error shows here and not first on a GPU machine. NVIDIA's nvcc 13.0 (the
# CUDA of current torch CUDA builds) compiles each source for sm_80 and sm_90 with the flags torch's
# own CUDA extensions use, against the torch headers of .venv, warnings as errors (nvcc's and g++'s).
# The object and each architecture's cubin go to build/cuda-check. Nothing is linked or run.
#
# The toolkit comes from NVIDIA's wheels on PyPI (nvidia-cuda-nvcc, -crt, -runtime, -cccl and
# nvidia-nvvm: about 105 MB to fetch), unpacked once into build/cuda-sdk.
#   PYTHON   interpreter whose torch headers to compile against (default .venv/bin/python)
#   CXX      host compiler for nvcc (default g++)
# Exit status: 0 compiled, 1 a compile error, 2 no toolchain (no host compiler, or the wheels could
# not be fetched).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
CUDA_VERSION=13.0
CU=cu${CUDA_VERSION%%.*}  # the wheels' folder, nvidia/cu13
ARCHS=(80 90)
SDK=build/cuda-sdk
OUT=build/cuda-check

missing() { echo "[cuda] $*" >&2; exit 2; }

command -v "${CXX:-g++}" >/dev/null || missing "no host C++ compiler (${CXX:-g++}) for nvcc: install g++"
TORCH_INCLUDE=$("$PYTHON" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))') \
  || missing "no Python with torch found ($PYTHON): run scripts/setup.sh"

# The wheels unpack into one toolkit tree, nvidia/$CU/{bin,include,nvvm,lib}, as nvcc expects.
NVCC=$SDK/nvidia/$CU/bin/nvcc
if [ ! -f "$SDK/ready-$CUDA_VERSION" ]; then
  echo "[cuda] fetching nvcc $CUDA_VERSION from PyPI into $SDK"
  rm -rf "$SDK" && mkdir -p "$SDK/wheels"
  "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: -d "$SDK/wheels" \
    "nvidia-cuda-nvcc==$CUDA_VERSION.*" "nvidia-cuda-crt==$CUDA_VERSION.*" "nvidia-nvvm==$CUDA_VERSION.*" \
    "nvidia-cuda-runtime==$CUDA_VERSION.*" "nvidia-cuda-cccl==$CUDA_VERSION.*" \
    || missing "could not fetch the CUDA $CUDA_VERSION wheels from PyPI"
  for wheel in "$SDK"/wheels/*.whl; do "$PYTHON" -m zipfile -e "$wheel" "$SDK"; done
  chmod +x "$SDK/nvidia/$CU"/bin/* "$SDK/nvidia/$CU"/nvvm/bin/*  # zipfile drops the mode bits
  # torch's generated CUDA macros header, which a CPU build of torch lacks (a CUDA build has it):
  # searched after torch's own include directory.
  mkdir -p "$SDK/shim/c10/cuda/impl"
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' >"$SDK/shim/c10/cuda/impl/cuda_cmake_macros.h"
  rm -rf "$SDK/wheels"
  touch "$SDK/ready-$CUDA_VERSION"
fi

flags=(-std=c++20 -O3 -ccbin "${CXX:-g++}" -Xcompiler=-fPIC,-Wall,-Wextra,-Werror -Werror all-warnings
  # what torch's CUDA extensions compile with (torch.utils.cpp_extension), so the check is no laxer
  -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
  -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr
  -isystem "$TORCH_INCLUDE" -isystem "$TORCH_INCLUDE/torch/csrc/api/include" -isystem "$SDK/shim")
for arch in "${ARCHS[@]}"; do flags+=(-gencode "arch=compute_$arch,code=sm_$arch"); done

rm -rf "$OUT" && mkdir -p "$OUT/keep"
echo "[cuda] nvcc $("$NVCC" --version | grep -o 'release [0-9.]*'), architectures ${ARCHS[*]}"
start=$(date +%s)
for source in kernels/*.cu; do
  name=$(basename "$source" .cu)
  "$NVCC" "${flags[@]}" --keep --keep-dir "$OUT/keep" -c "$source" -o "$OUT/$name.o" \
    || { echo "[cuda] $source does not compile" >&2; exit 1; }
  for arch in "${ARCHS[@]}"; do
    mv "$OUT/keep/$name.compute_$arch.cubin" "$OUT/$name.sm_$arch.cubin"
    mv "$OUT/keep/$name.compute_$arch.ptx" "$OUT/$name.sm_$arch.ptx"
    echo "[cuda] $source: sm_$arch cubin, $(wc -c <"$OUT/$name.sm_$arch.cubin") bytes"
  done
  echo "[cuda] $source: object, $(wc -c <"$OUT/$name.o") bytes"
done
rm -rf "$OUT/keep"
echo "[cuda] compiled in $(($(date +%s) - start))s"
