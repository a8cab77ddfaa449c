"""bench/rope_shift.py at a small context on CPU: every backend that serves the device runs both
operations and agrees with the torch reference; the table comes first, the JSON last."""

import subprocess

import torch

from rig_decode.kernels import native

from .helpers import bench_output, run_bench


def _run(*args: str) -> subprocess.CompletedProcess:
    return run_bench("rope_shift.py", "--device", "cpu", *args, timeout=300)


def test_backends_agree_with_the_reference():
    lines, result = bench_output(_run("--context", "128", "--span", "16", "--repeats", "2"))
    assert lines[0].split()[:3] == ["op", "backend", "positions"]
    assert (result["layers"], result["context"], result["span"], result["dtype"]) == (30, 128, 16, "float32")
    expected = {"torch", "native"} if native.supports(torch.device("cpu")) else {"torch"}
    positions = {"evict": 128 - (128 - 16) // 2 - 16, "stage": 16}
    for op, per in result["ops"].items():
        assert per["positions"] == positions[op]
        ran = set(per) - {"positions", "fastest", "speedup_vs_torch"}
        assert ran == expected, (op, ran)
        for backend in ran:
            assert per[backend]["ms"] > 0 and per[backend]["max_abs_diff"] <= 1e-5, (op, backend, per[backend])
            assert per[backend]["syncs"] is None  # counted on CUDA only
        assert per["fastest"] in ran and per["speedup_vs_torch"] >= 1.0
    assert set(result["ops"]) == {"evict", "stage"}


def test_a_span_beyond_the_context_is_refused():
    proc = _run("--context", "64", "--span", "64")
    assert proc.returncode != 0 and "--span must be between 1 and the context (64)" in proc.stderr
