#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one run, most important first: bench/gpu.py (Qwen2.5-32B
# shapes in nf4 under a 24 GiB cap), then the native extension built with its CUDA kernel, then
# bench/rope_shift.py (torch, Triton and native re-rotation at Qwen2.5-32B's KV shapes) and the kernel
# tests on the GPU (Triton and native against the torch reference). Each step has a time
# limit and a log; one that fails does not stop the others. Each step's summary line is printed
# (and appended to DIR/summary.txt) as it ends; the exit status is 1 if any step failed. Where
# the Triton kernel fails its first launch (no C compiler, no libcuda), the bench re-rotates keys
# with torch instead (RIG_KERNELS=torch), so its figures still come; a bench stopped at its limit
# still writes the sections it finished.
#   usage: scripts/gpu_check.sh [DIR]     logs, the bench's table and JSON go to DIR (default out/gpu)
#   PYTHON      interpreter with a CUDA build of torch, transformers and bitsandbytes (default:
#               .venv/bin/python, else python3); rig_decode is used from this checkout
#   BENCH_S, BUILD_S, KERNELS_S, TESTS_S   time limits in seconds of those steps (default 240, 75,
#               40, 75: with the env and triton steps' 30 each, 490 s, and at most 5 s more per step
#               for one stopped at its limit to exit, under 9 minutes in all; each is sized for
#               less); TORCH_CUDA_ARCH_LIST defaults to this GPU's
set -uo pipefail
DIR=$(realpath -m "${1:-$(dirname "$0")/../out/gpu}")  # before the cd: relative to the caller
cd "$(dirname "$0")/.."

if [ -z "${PYTHON:-}" ]; then
  PYTHON=.venv/bin/python
  [ -x "$PYTHON" ] || PYTHON=python3
fi
command -v "$PYTHON" >/dev/null || { echo "[gpu-check] no interpreter $PYTHON" >&2; exit 2; }
mkdir -p "$DIR"
: >"$DIR/summary.txt"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
failed=0

# step NAME LIMIT_S COMMAND...: run it with its output in DIR/NAME.log, and note how it ended.
step() {
  local name=$1 limit=$2 start rc result
  shift 2
  echo "[gpu-check] $name (limit ${limit}s)" >&2
  start=$(date +%s)
  timeout -k 5 "$limit" "$@" >"$DIR/$name.log" 2>&1  # SIGTERM, then SIGKILL 5 s on
  rc=$?
  case $rc in 0) result=ok ;; 124) result=timed-out ;; *) result="rc=$rc" ;; esac
  [ "$rc" = 0 ] || failed=1
  printf '%-7s %-9s %5ss  %s\n' "$name" "$result" "$(($(date +%s) - start))" \
    "$(tail -n 1 "$DIR/$name.log" | cut -c1-110)" | tee -a "$DIR/summary.txt"
  return "$rc"
}

echo "step    result      time  last line of DIR/step.log" | tee -a "$DIR/summary.txt"
step env 30 "$PYTHON" -c '
import tomllib, torch, transformers
from importlib.metadata import PackageNotFoundError, version
from packaging.requirements import Requirement
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)
assert torch.cuda.is_available(), "CUDA is not available"
import bitsandbytes
print("bitsandbytes", bitsandbytes.__version__, "on", torch.cuda.get_device_name(0))
with open("pyproject.toml", "rb") as f:  # what importing rig_decode and the tests need, in the pinned ranges
    pins = [Requirement(d) for d in tomllib.load(f)["project"]["dependencies"]]
for req in pins:
    if req.name in ("transformers", "pydantic", "pyyaml"):
        try:
            have = version(req.name)
        except PackageNotFoundError:
            raise SystemExit(f"{req.name} is missing: need {req}")
        assert req.specifier.contains(have, prereleases=True), f"{req.name} {have} is outside {req}"
import pytest'

# One launch of the Triton kernel against the torch reference; without a working Triton the bench
# uses the torch reference.
if ! step triton 30 env RIG_KERNELS=triton "$PYTHON" -c '
import torch
from rig_decode import kernels
keys = torch.randn(2, 8, 64, 128, device="cuda", dtype=torch.bfloat16)
rows, cols = torch.tensor([0, 1, 1]), torch.tensor([5, 0, 63])
shift, inv_freq = torch.tensor([-40.0, 7.0, 4000.0]), 1 / 1e6 ** (torch.arange(0, 128, 2) / 128)
want = kernels.rope_shift_ref_(keys.clone(), rows.cuda(), cols.cuda(), shift.cuda(), inv_freq.cuda())
torch.testing.assert_close(kernels.rope_shift_(keys, rows, cols, shift, inv_freq), want, atol=2e-2, rtol=2e-2)
print("triton: ok")'; then
  export RIG_KERNELS=torch
fi

# The benchmark's table and JSON go to DIR/bench.txt (written even when the limit stops it: it
# catches SIGTERM), its progress to DIR/bench.log.
step bench "${BENCH_S:-240}" bash -c 'exec "$1" bench/gpu.py --device cuda >"$2/bench.txt"' _ "$PYTHON" "$DIR"

arch=$("$PYTHON" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null)
if step native "${BUILD_S:-75}" env PYTHON="$PYTHON" JOBS="$(nproc)" \
    TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$arch}" scripts/build_native.sh; then
  native=1
else
  native=0  # the native tests would only try the same build again
fi
step kernels "${KERNELS_S:-40}" env RIG_KERNELS=auto "$PYTHON" bench/rope_shift.py --device cuda --model qwen2.5-32b
step tests "${TESTS_S:-75}" env RIG_KERNELS=auto RIG_NATIVE="$native" "$PYTHON" -m pytest -q -p no:cacheprovider -rs \
  tests/test_native.py tests/test_kernels.py

[ -s "$DIR/bench.txt" ] && { echo; cat "$DIR/bench.txt"; }
exit "$failed"
