#!/usr/bin/env bash
# Set up (idempotent) and run the whole test-suite, the real-model tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export RIG_REQUIRE_REAL_MODEL=1
# pytest exits 5 when it collected no test: that fails this script like any other failure.
exec .venv/bin/python -m pytest -q "$@"
