#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one run, most important first: bench/gpu.py (Qwen2.5-32B
# shapes in nf4 under a 24 GiB cap), then the native extension built with its CUDA kernel, then the
# kernel tests on the GPU (Triton and native against the torch reference). Each step has a time
# limit and a log; one that fails does not stop the others. Ends with a summary table.
#   usage: scripts/gpu_check.sh [DIR]     logs, the bench's table and JSON go to DIR (default out/gpu)
#   PYTHON      interpreter with a CUDA build of torch, transformers and bitsandbytes (default:
#               .venv/bin/python, else python3); rig_decode is used from this checkout
#   BENCH_S     time limit of bench/gpu.py in seconds (default 480: the benchmark is sized for less)
#   BUILD_S     time limit of the native build (default 240); TORCH_CUDA_ARCH_LIST defaults to this GPU's
set -uo pipefail
cd "$(dirname "$0")/.."

DIR=${1:-out/gpu}
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
mkdir -p "$DIR"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
summary=()

# step NAME LIMIT_S COMMAND...: run it with its output in DIR/NAME.log, and note how it ended.
step() {
  local name=$1 limit=$2 start rc
  shift 2
  echo "[gpu-check] $name (limit ${limit}s)" >&2
  start=$(date +%s)
  timeout "$limit" "$@" >"$DIR/$name.log" 2>&1
  rc=$?
  summary+=("$(printf '%-8s %-9s %6ss  %s' "$name" "$([ $rc = 0 ] && echo ok || { [ $rc = 124 ] && echo timed-out || echo "rc=$rc"; })" \
    "$(($(date +%s) - start))" "$(tail -n 1 "$DIR/$name.log" | cut -c1-120)")")
  return $rc
}

step env 60 "$PYTHON" -c '
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)
assert torch.cuda.is_available(), "CUDA is not available"
import bitsandbytes
print("bitsandbytes", bitsandbytes.__version__, "on", torch.cuda.get_device_name(0))' || true

# The benchmark writes its table and JSON to stdout, progress to stderr.
step bench "${BENCH_S:-480}" bash -c "set -o pipefail; '$PYTHON' bench/gpu.py 2>'$DIR/bench.progress' | tee '$DIR/bench.txt'" || true

arch=$("$PYTHON" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null)
step native "${BUILD_S:-240}" env PYTHON="$PYTHON" JOBS="$(nproc)" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$arch}" \
  scripts/build_native.sh || true
step tests 300 "$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/test_native.py tests/test_kernels.py || true

echo
echo "step     result      time  last line of DIR/step.log"
printf '%s\n' "${summary[@]}"
[ -s "$DIR/bench.txt" ] && { echo; cat "$DIR/bench.txt"; }
