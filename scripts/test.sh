#!/usr/bin/env bash
# Set up (idempotent) and run the whole test-suite, the real-model tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# The playground test drives Debian's Chromium; install it where we may (root with apt), else it is skipped.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "[test] installing chromium for the playground test"
  (apt-get install -y -q chromium >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1)) \
    || echo "[test] could not install chromium: the playground test will be skipped"
fi
export RIG_REQUIRE_REAL_MODEL=1
if command -v cmake >/dev/null && command -v c++ >/dev/null; then
  ./scripts/build_native.sh
else
  echo "[test] cmake or c++ not found: the native extension is not built and its tests will be skipped"
fi
# pytest exits 5 when it collected no test: that fails this script like any other failure.
exec .venv/bin/python -m pytest -q "$@"
