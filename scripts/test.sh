#!/usr/bin/env bash
# Set up (idempotent) and run the whole test-suite, the real-model tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# Debian packages some tests need, installed where we may (root with apt), else those tests are skipped.
apt_install() {  # command package what-for
  command -v "$1" >/dev/null && return
  command -v apt-get >/dev/null && [ "$(id -u)" = 0 ] || return 0
  echo "[test] installing $2 for $3"
  (apt-get install -y -q "$2" >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "$2" >/dev/null 2>&1)) \
    || echo "[test] could not install $2: $3 will be skipped"
}
apt_install chromium chromium "the playground test"  # drives Debian's Chromium
apt_install clang++-19 clang-19 "the CUDA compile test"  # scripts/check_cuda.sh: CUDA without nvcc
export RIG_REQUIRE_REAL_MODEL=1
if command -v cmake >/dev/null && command -v c++ >/dev/null; then
  ./scripts/build_native.sh
else
  echo "[test] cmake or c++ not found: the native extension is not built and its tests will be skipped"
fi
# pytest exits 5 when it collected no test: that fails this script like any other failure.
exec .venv/bin/python -m pytest -q "$@"
