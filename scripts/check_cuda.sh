#!/usr/bin/env bash
# Compile the CUDA kernels (rig_decode/kernels/csrc/*.cu) without nvcc or a GPU, so that a compile
# error shows here and not first on a GPU machine. clang (17 or newer) compiles the device code to a
# cubin per GPU architecture, through NVIDIA's ptxas, and the host code to an object, against the
# torch headers of .venv, with -Wall -Wextra -Werror. Nothing is linked or run.
#
# The CUDA headers, ptxas and libdevice come from NVIDIA's wheels on PyPI (nvidia-cuda-nvcc,
# -runtime and -cccl; 45 MB to fetch), kept in build/cuda-sdk.
#   CLANG        clang++ to use (default: the newest clang++-N on PATH, N >= 17, else clang++)
#   CUDA_ARCHS   GPU architectures (default "sm_80 sm_90": A100, H100 / H200)
#   CUDA_WHEELS  version of the CUDA wheels (default 12.8)
#   PYTHON       interpreter whose torch headers to compile against (default .venv/bin/python)
# Exit status: 0 compiled, 1 a compile error, 2 no toolchain (no clang >= 17, or the wheels could
# not be fetched).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
CUDA_ARCHS=${CUDA_ARCHS:-sm_80 sm_90}
CUDA_WHEELS=${CUDA_WHEELS:-12.8}
SDK=build/cuda-sdk
OUT=build/cuda-check

missing() { echo "[cuda] $*" >&2; exit 2; }

clang_major() { "$1" --version 2>/dev/null | sed -n 's/.*clang version \([0-9]*\).*/\1/p' | head -n 1; }
if [ -z "${CLANG:-}" ]; then
  for candidate in clang++-{25..17} clang++; do
    major=$(clang_major "$candidate" || true)
    if [ -n "$major" ] && [ "$major" -ge 17 ]; then CLANG=$candidate; break; fi
  done
fi
[ -n "${CLANG:-}" ] || missing "no clang++ 17 or newer found (Debian: apt-get install clang-19; or set CLANG)"

TORCH_INCLUDE=$("$PYTHON" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))') \
  || missing "no Python with torch found ($PYTHON): run scripts/setup.sh"

# The SDK layout clang expects of --cuda-path: include/, bin/ptxas, nvvm/libdevice/.
if [ ! -f "$SDK/ready-$CUDA_WHEELS" ]; then
  echo "[cuda] fetching the CUDA $CUDA_WHEELS headers, ptxas and libdevice from PyPI into $SDK"
  rm -rf "$SDK" && mkdir -p "$SDK/wheels" "$SDK/bin" "$SDK/include" "$SDK/shim/c10/cuda/impl"
  "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: -d "$SDK/wheels" \
    "nvidia-cuda-nvcc-cu12==$CUDA_WHEELS.*" "nvidia-cuda-runtime-cu12==$CUDA_WHEELS.*" \
    "nvidia-cuda-cccl-cu12==$CUDA_WHEELS.*" || missing "could not fetch the CUDA wheels from PyPI"
  for wheel in "$SDK"/wheels/*.whl; do "$PYTHON" -m zipfile -e "$wheel" "$SDK/wheels/files"; done
  nv="$SDK/wheels/files/nvidia"
  cp -r "$nv"/cuda_runtime/include/. "$nv"/cuda_nvcc/include/. "$nv"/cuda_cccl/include/. "$SDK/include/"
  mkdir -p "$SDK/nvvm" && cp -r "$nv/cuda_nvcc/nvvm/libdevice" "$SDK/nvvm/"
  cp "$nv/cuda_nvcc/bin/ptxas" "$SDK/bin/" && chmod +x "$SDK/bin/ptxas"
  # Two headers a CUDA toolkit and a CUDA build of torch have and these do not; neither is used by
  # the kernels: torch's generated CUDA macros (a CPU build of torch lacks them), and a cuRAND header
  # that clang's CUDA wrapper includes. Found after every real include directory (-idirafter).
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' >"$SDK/shim/c10/cuda/impl/cuda_cmake_macros.h"
  : >"$SDK/shim/curand_mtgp32_kernel.h"
  rm -rf "$SDK/wheels"
  touch "$SDK/ready-$CUDA_WHEELS"
fi

flags=(-x cuda --cuda-path="$SDK" -std=c++20 -O3 -fPIC -Wall -Wextra -Werror -Wno-unknown-cuda-version
  -isystem "$TORCH_INCLUDE" -isystem "$TORCH_INCLUDE/torch/csrc/api/include" -idirafter "$SDK/shim")
mkdir -p "$OUT"
echo "[cuda] $("$CLANG" --version | head -n 1), CUDA $CUDA_WHEELS headers, architectures: $CUDA_ARCHS"
start=$(date +%s)
for source in rig_decode/kernels/csrc/*.cu; do
  name=$(basename "$source" .cu)
  for arch in $CUDA_ARCHS; do
    "$CLANG" "${flags[@]}" --cuda-gpu-arch="$arch" --cuda-device-only -c "$source" -o "$OUT/$name.$arch.cubin" \
      || { echo "[cuda] $source: device code for $arch does not compile" >&2; exit 1; }
    echo "[cuda] $source: $arch cubin, $(wc -c <"$OUT/$name.$arch.cubin") bytes"
  done
  "$CLANG" "${flags[@]}" --cuda-gpu-arch="${CUDA_ARCHS%% *}" --cuda-host-only -c "$source" -o "$OUT/$name.host.o" \
    || { echo "[cuda] $source: host code does not compile" >&2; exit 1; }
  echo "[cuda] $source: host object, $(wc -c <"$OUT/$name.host.o") bytes"
done
echo "[cuda] compiled in $(($(date +%s) - start))s"
