#!/usr/bin/env bash
# Build the optional native extension rig_decode/_C*.so (CMakeLists.txt) against the torch of .venv
# (or $PYTHON). Safe to re-run: an up-to-date build does nothing.
#   PYTHON     interpreter whose torch to build against (default .venv/bin/python, else python3)
#   JOBS       parallel compile jobs (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=$(command -v python3 || true)
BUILD_DIR=build/native

fail() { echo "[native] $*" >&2; exit 1; }
command -v cmake >/dev/null || fail "cmake not found: install it (apt-get install cmake, or pip install cmake)"
command -v "${CXX:-c++}" >/dev/null || fail "no C++ compiler (${CXX:-c++}) found: install g++ (apt-get install g++)"
# One interpreter start (importing torch takes seconds): cmake prefix, CUDA version, interpreter path.
info=$("$PYTHON" -c 'import sys, torch
print(torch.utils.cmake_prefix_path); print(torch.version.cuda or ""); print(sys.executable)' 2>/dev/null) \
  || fail "no Python with torch found (${PYTHON:-python3}): run scripts/setup.sh"
{ read -r TORCH_PREFIX; read -r TORCH_CUDA; read -r PYTHON; } <<<"$info"
# A CUDA build of torch cannot even be configured without the CUDA toolkit (its CMake config asks for it).
if [ -n "$TORCH_CUDA" ] && ! command -v nvcc >/dev/null; then
  [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] || fail "torch is a CUDA $TORCH_CUDA build, whose CMake config" \
    "needs the CUDA toolkit (nvcc): none found; install it (or set CUDA_HOME), or use a CPU build of torch"
  export CUDACXX=${CUDACXX:-${CUDA_HOME:-/usr/local/cuda}/bin/nvcc}  # CMake looks on PATH and in CUDACXX only
fi

start=$(date +%s)
# CMake keeps the torch it first found in its cache, whatever CMAKE_PREFIX_PATH says later: a build
# directory configured for another torch (another interpreter) is started afresh.
if [ -d "$BUILD_DIR" ] && [ "$(cat "$BUILD_DIR/torch-prefix" 2>/dev/null)" != "$TORCH_PREFIX" ]; then
  rm -rf "$BUILD_DIR"
fi
mkdir -p "$BUILD_DIR"
echo "$TORCH_PREFIX" >"$BUILD_DIR/torch-prefix"
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" \
  -DPython3_EXECUTABLE="$PYTHON" >"$BUILD_DIR/configure.log" 2>&1 \
  || { cat "$BUILD_DIR/configure.log" >&2; fail "cmake configure failed (log above)"; }
grep -h '^-- rig_decode:' "$BUILD_DIR/configure.log" || true
cmake --build "$BUILD_DIR" -j "${JOBS:-2}"
echo "[native] done in $(($(date +%s) - start))s: $(ls -t rig_decode/_C*.so | head -n 1)"
