#!/usr/bin/env bash
# Build llama.cpp's llama-server (CPU only) from the llama.cpp tree vendored in the pinned
# llama-cpp-python sdist on PyPI, into build/llama.cpp/. A rerun with a working binary does nothing.
# Progress goes to stderr; the last two lines on stdout are RIG_LLAMA_SERVER=<path> and
# RIG_LLAMA_CONVERT=<path to convert_hf_to_gguf.py>:   eval "$(scripts/build_llama.sh | tail -2)"
#   PYTHON     interpreter whose pip downloads the sdist (default python3, else .venv/bin/python)
#   JOBS       parallel compile jobs (default 2)
# The binary is built with GGML_NATIVE=ON: it may not run on a machine with an older CPU.
set -euo pipefail
cd "$(dirname "$0")/.."

VER=0.3.36   # llama-cpp-python; its vendor/llama.cpp has tools/server and convert_hf_to_gguf.py
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
ROOT=$PWD/build/llama.cpp
SRC=$ROOT/src-$VER       # the vendored llama.cpp tree (its root)
BUILD=$ROOT/build-$VER
SERVER=$BUILD/bin/llama-server
CONVERT=$SRC/convert_hf_to_gguf.py

log() { echo "[build_llama] $*" >&2; }
fail() { log "$*"; exit 1; }
finish() { echo "RIG_LLAMA_SERVER=$SERVER"; echo "RIG_LLAMA_CONVERT=$CONVERT"; exit 0; }

if [ -x "$SERVER" ] && [ -f "$SRC/.extracted" ] && "$SERVER" --version >/dev/null 2>&1; then
  log "llama-server (llama-cpp-python $VER) already built: $SERVER"
  finish
fi

command -v cmake >/dev/null || fail "cmake not found: install it (apt-get install cmake, or pip install cmake)"
command -v "${CXX:-c++}" >/dev/null || fail "no C++ compiler (${CXX:-c++}) found: install g++ (apt-get install g++)"
command -v "${CC:-cc}" >/dev/null || fail "no C compiler (${CC:-cc}) found: install gcc (apt-get install gcc)"
start=$(date +%s)

# 1. Sources: the sdist (llama-cpp-python has no wheels on PyPI) vendors llama.cpp in vendor/llama.cpp.
if [ ! -f "$SRC/.extracted" ]; then
  PYTHON=${PYTHON:-python3}
  command -v "$PYTHON" >/dev/null || PYTHON=.venv/bin/python
  "$PYTHON" -m pip --version >/dev/null 2>&1 || fail "no pip found ($PYTHON): set PYTHON to an interpreter with pip"
  DL=$ROOT/dl
  mkdir -p "$DL"
  sdist=$DL/llama_cpp_python-$VER.tar.gz
  if [ ! -f "$sdist" ] || [ "$(sha256sum "$sdist" | cut -d' ' -f1)" != "$SHA256" ]; then
    rm -f "$sdist"
    log "downloading the llama-cpp-python==$VER sdist from PyPI"
    # pip prepares the sdist's metadata in an isolated env (a scikit-build-core wheel): nothing is built.
    "$PYTHON" -m pip download --no-deps --no-binary llama-cpp-python --disable-pip-version-check \
      -d "$DL" "llama-cpp-python==$VER" >&2 || fail "pip download of llama-cpp-python==$VER failed"
  fi
  [ "$(sha256sum "$sdist" | cut -d' ' -f1)" = "$SHA256" ] || fail "$sdist: sha256 mismatch (want $SHA256)"
  log "extracting vendor/llama.cpp into $SRC"
  rm -rf "$SRC" "$SRC.tmp"
  mkdir -p "$SRC.tmp"
  # The tokenizer-vocab .gguf files under models/ (~75 MB) serve llama.cpp's own tests only.
  tar -xzf "$sdist" -C "$SRC.tmp" --strip-components=3 --exclude='*/models/*.gguf' \
    "llama_cpp_python-$VER/vendor/llama.cpp"
  [ -f "$SRC.tmp/convert_hf_to_gguf.py" ] && [ -f "$SRC.tmp/tools/server/CMakeLists.txt" ] \
    || fail "$sdist: vendor/llama.cpp lacks convert_hf_to_gguf.py or tools/server"
  touch "$SRC.tmp/.extracted"
  mv "$SRC.tmp" "$SRC"
  rm -f "$sdist"
fi

# 2. Configure and build llama-server only: CPU backend, static, no HTTPS, no web UI (no npm, no
# download). The sources are no git checkout (and lie inside this repo's): name the build
# explicitly, or llama.cpp's build-info would report this repo's commit.
mkdir -p "$BUILD"
log "configuring llama.cpp in $BUILD"
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON \
  -DGGML_CUDA=OFF -DGGML_HIP=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_SYCL=OFF -DGGML_BLAS=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_NUMBER=0 -DLLAMA_BUILD_COMMIT="pypi-llama-cpp-python-$VER" \
  >"$BUILD/configure.log" 2>&1 || { cat "$BUILD/configure.log" >&2; fail "cmake configure failed (log above)"; }
log "building llama-server with ${JOBS:-2} jobs"
cmake --build "$BUILD" --target llama-server -j "${JOBS:-2}" >&2 || fail "cmake build of llama-server failed"
"$SERVER" --version >/dev/null 2>&1 || fail "$SERVER was built but does not run (--version failed)"
log "done in $(($(date +%s) - start))s: $SERVER"
finish
