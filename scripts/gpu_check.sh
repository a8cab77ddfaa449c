#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one run under TOTAL_S (default 465 s, for a 480 s slot),
# most important first: bench/gpu.py (decode eager vs compiled beside the card's bound, an 8k
# prefill chunked vs in one forward under a real 24 GiB cap, then the hop, evict, search and memory
# of Qwen2.5-32B shapes in int4 under that cap), then the native extension built with its CUDA
# kernel, bench/rope_shift.py and the kernel tests on the GPU. Each step has a time limit and a log;
# one that fails does not stop the others. Each step's limit is cut to what is left of TOTAL_S, and a
# step with under 15 s left is skipped, so the whole check ends in time. Each step's summary line is
# printed (and appended to DIR/summary.txt) as it ends; the exit status is 1 if any step failed,
# timed out or was skipped for time. Where the Triton kernel fails its first launch (no C compiler,
# no libcuda), the bench re-rotates keys with torch instead (RIG_KERNELS=torch); a bench stopped at
# its limit still writes the sections it finished.
#
# Time per step on one H100 (estimates: no run of this version on a card yet; the nf4 bench of
# 2026-12-04 took 61.5 s on an H200), with each limit:
#   env      ~10 s (imports)                                                  limit ENV_S 30
#   triton   ~10 s (one kernel build and launch)                              limit TRITON_S 30
#   bench    ~250 s, limit BENCH_S 330; inside it, in order:
#            decode: decode_step.py in a process of its own, int4 at 32B widths with DECODE_LAYERS
#              (16) of the 64 layers: ~10 s start, ~3 s build, hf at batch 1 and 8 ~5 s, compiled
#              ~40 s per batch size (a compile and CUDA-graph capture; batch 8 recompiles) -> ~100 s
#              (limit 200 s; nf4 again as much, only where bitsandbytes is installed). All 64 layers
#              would compile for minutes: tokens/s are the 16 layers', and their % of the bound is
#              a floor for 64's (a fixed cost per step weighs 4x less there).
#            long prefill: prefill_cap.py, all 64 layers, 8,192 tokens in chunks of 512, then in
#              one forward: ~10 s start, ~5 s build, ~10 s per prefill -> ~35 s (limit 120 s)
#            the rest, in this process, all 64 layers: build ~5 s, 1M-vector index ~2 s, hops at
#              2k and 8k ~60 s, zero-prefill ~30 s, evict ~10 s, search and memory ~2 s -> ~110 s
#   native   ~50 s (48 s on the H200)                                         limit BUILD_S 75
#   kernels  ~20 s                                                            limit KERNELS_S 40
#   tests    ~60 s                                                            limit TESTS_S 75
# In all ~400 s estimated; the limits add up to more (580 s), which TOTAL_S cuts from the end.
#
#   usage: scripts/gpu_check.sh [--dry-run] [DIR]   logs, the bench's table and JSON go to DIR
#                                                   (default out/gpu); --dry-run prints each step's
#                                                   limit and command and runs none, each step taken
#                                                   to use its whole limit (the worst case)
#   PYTHON      interpreter with a CUDA build of torch, transformers, pydantic, pyyaml (bitsandbytes
#               optional: nf4 is then measured beside int4); default .venv/bin/python, else python3;
#               rig_decode is used from this checkout
#   QUANT       the 4-bit format of the bench's model (default int4: bitsandbytes not needed)
#   DECODE_LAYERS  layers of the decode's model (default: bench/gpu.py's, 16; 0: all 64)
#   GPU_CHECK_DEVICE=cpu  without a GPU: the env step and the bench at its small shapes on the CPU
#               (in seconds), the CUDA-only steps skipped; without it and without CUDA the check
#               stops at once (exit 2)
#   TOTAL_S, ENV_S, TRITON_S, BENCH_S, BUILD_S, KERNELS_S, TESTS_S   the limits above, in seconds;
#               TORCH_CUDA_ARCH_LIST defaults to this GPU's
set -uo pipefail
now=$(date +%s)  # TOTAL_S counts from here; a dry run's clock: each step takes its whole limit, and 5 s more
dry=0
[ "${1:-}" = "--dry-run" ] && { dry=1; shift; }
DIR=$(realpath -m "${1:-$(dirname "$0")/../out/gpu}")  # before the cd: relative to the caller
cd "$(dirname "$0")/.."

if [ -z "${PYTHON:-}" ]; then
  PYTHON=.venv/bin/python
  [ -x "$PYTHON" ] || PYTHON=python3
fi
command -v "$PYTHON" >/dev/null || { echo "[gpu-check] no interpreter $PYTHON" >&2; exit 2; }
device=${GPU_CHECK_DEVICE:-cuda}
case $device in cuda | cpu) ;; *) echo "[gpu-check] GPU_CHECK_DEVICE is cuda or cpu, not $device" >&2; exit 2 ;; esac
if [ "$device" = cuda ] && [ "$dry" = 0 ] && ! "$PYTHON" -c 'import sys, torch
sys.exit(0 if torch.cuda.is_available() else 3)' 2>/dev/null; then
  echo "[gpu-check] no CUDA device that $PYTHON's torch can use (or no torch): this check needs one. Without a GPU," \
    "GPU_CHECK_DEVICE=cpu $0 runs its bench at small shapes on the CPU, and --dry-run prints its steps." >&2
  exit 2
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
[ "$dry" = 1 ] || { mkdir -p "$DIR" && : >"$DIR/summary.txt"; }
deadline=$((now + ${TOTAL_S:-465}))
failed=0

clock() {
  if [ "$dry" = 1 ]; then echo "$now"; else date +%s; fi
}

# note LINE: a summary line, on stdout and in DIR/summary.txt.
note() {
  if [ "$dry" = 1 ]; then echo "$1"; else echo "$1" | tee -a "$DIR/summary.txt"; fi
}

# skip NAME WHY: a step not run; a step skipped for time fails the check, one that does not apply
# on this device does not.
skip() {
  note "$(printf '%-7s %-9s %5ss  %s' "$1" skipped 0 "$2")"
  [ "$2" = "no time left" ] && failed=1
  return 1
}

# step NAME LIMIT_S COMMAND...: run it with its output in DIR/NAME.log, under LIMIT_S or what is
# left of TOTAL_S, and note how it ended.
step() {
  local name=$1 limit=$2 start rc result left
  shift 2
  left=$((deadline - $(clock) - 5))  # 5 s for a stopped step to exit
  [ "$limit" -le "$left" ] || limit=$left
  [ "$limit" -ge 15 ] || { skip "$name" "no time left"; return 1; }
  if [ "$dry" = 1 ]; then  # an inline script shows as <script>
    local a shown=()
    for a in "$@"; do [[ $a == *$'\n'* ]] && shown+=("<script>") || shown+=("$(printf '%q' "$a")"); done
    echo "$name limit ${limit}s: ${shown[*]}"
    now=$((now + limit + 5))
    return 0
  fi
  echo "[gpu-check] $name (limit ${limit}s)" >&2
  start=$(date +%s)
  timeout -k 5 "$limit" "$@" >"$DIR/$name.log" 2>&1  # SIGTERM, then SIGKILL 5 s on
  rc=$?
  case $rc in 0) result=ok ;; 124) result=timed-out ;; *) result="rc=$rc" ;; esac
  [ "$rc" = 0 ] || failed=1
  note "$(printf '%-7s %-9s %5ss  %s' "$name" "$result" "$(($(date +%s) - start))" \
    "$(tail -n 1 "$DIR/$name.log" | cut -c1-110)")"
  return "$rc"
}

note "step    result      time  last line of DIR/step.log"
step env "${ENV_S:-30}" env GPU_CHECK_DEVICE="$device" "$PYTHON" -c '
import os, tomllib, torch, transformers
from importlib.metadata import PackageNotFoundError, version
from packaging.requirements import Requirement
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)
if os.environ["GPU_CHECK_DEVICE"] == "cuda":
    assert torch.cuda.is_available(), "CUDA is not available"
    print("on", torch.cuda.get_device_name(0))
try:
    import bitsandbytes
    print("bitsandbytes", bitsandbytes.__version__, "(on CUDA the decode measures nf4 beside int4)")
except ImportError:
    print("bitsandbytes: not installed (decode measures int4 only)")
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
if [ "$device" = cpu ]; then
  skip triton "needs CUDA"
elif ! step triton "${TRITON_S:-30}" env RIG_KERNELS=triton "$PYTHON" -c '
import torch
from rig_decode import kernels
keys = torch.randn(2, 8, 64, 128, device="cuda", dtype=torch.bfloat16)
rows, cols = torch.tensor([0, 1, 1]), torch.tensor([5, 0, 63])
shift, inv_freq = torch.tensor([-40.0, 7.0, 4000.0]), 1 / 1e6 ** (torch.arange(0, 128, 2) / 128)
want = kernels.rope_shift_ref_(keys.clone(), rows.cuda(), cols.cuda(), shift.cuda(), inv_freq.cuda())
torch.testing.assert_close(kernels.rope_shift_(keys, rows, cols, shift, inv_freq), want, atol=2e-2, rtol=2e-2)
print("triton: ok")'; then
  [ "$dry" = 1 ] || export RIG_KERNELS=torch
fi

# The benchmark's table and JSON go to DIR/bench.txt (written even when the limit stops it: it
# catches SIGTERM), its progress and its sub-benchmarks' to DIR/bench.log.
bench=("$PYTHON" bench/gpu.py --device "$device" --quant "${QUANT:-int4}")
[ -z "${DECODE_LAYERS:-}" ] || bench+=(--decode-layers "$DECODE_LAYERS")
step bench "${BENCH_S:-330}" bash -c 'out=$1; shift; exec "$@" >"$out"' _ "$DIR/bench.txt" "${bench[@]}"

if [ "$device" = cpu ]; then
  for name in native kernels tests; do skip "$name" "needs CUDA"; done
else
  arch=$([ "$dry" = 1 ] || "$PYTHON" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null)
  if step native "${BUILD_S:-75}" env PYTHON="$PYTHON" JOBS="$(nproc)" \
      TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$arch}" scripts/build_native.sh; then
    native=1
  else
    native=0  # the native tests would only try the same build again
  fi
  step kernels "${KERNELS_S:-40}" env RIG_KERNELS=auto "$PYTHON" bench/rope_shift.py --device cuda --model qwen2.5-32b
  step tests "${TESTS_S:-75}" env RIG_KERNELS=auto RIG_NATIVE="$native" "$PYTHON" -m pytest -q -p no:cacheprovider -rs \
    tests/test_native.py tests/test_kernels.py
fi

[ "$dry" = 0 ] && [ -s "$DIR/bench.txt" ] && { echo; cat "$DIR/bench.txt"; }
exit "$failed"
