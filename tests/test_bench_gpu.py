"""bench/gpu.py at its small CPU shapes: every section runs, the table comes first, the JSON last."""

import json
import signal
import subprocess
import sys

import pytest

from .helpers import ROOT, bench_output, run_bench


def _run(*args: str) -> subprocess.CompletedProcess:
    return run_bench("gpu.py", "--device", "cpu", *args, timeout=300)


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _check(proc: subprocess.CompletedProcess) -> dict:
    lines, result = bench_output(proc)
    assert lines[0].split() == ["section", "metric", "value", "unit"]
    table = "\n".join(lines)
    for section in ("decode", "evidence prefill", "hop", "zero-prefill", "evict", "search", "rerank", "memory"):
        assert f"\n{section} " in table, section

    assert result["bench"] == "gpu" and result["device"] == "cpu" and result["shapes"] == "small"
    assert result["errors"] == {} and result["complete"] is True
    contexts = [str(c) for c in result["contexts"]]
    assert contexts == ["256", "512"]
    assert set(result["decode_tok_s"]) == {"1", "8"}
    assert all(_positive(v) for v in result["decode_tok_s"].values())
    for key in ("splice_ms", "reprefill_ms", "reprefill_over_splice", "zero_prefill_ms", "zero_prefill_deviation_ms",
                "zero_prefill_host_ms",
                "evidence_prefill_tok_s"):
        assert set(result[key]) == set(contexts), key
        assert all(_positive(v) for v in result[key].values()), (key, result[key])
    for key in ("cold_pieces_each_ms", "cold_pieces_packed_ms", "evict_ms", "search_ms", "weights_gb", "index_gb", "kv_bytes_per_token", "planned_max_kv_tokens",
                "peak_gb", "cap_gb"):
        assert _positive(result[key]), (key, result.get(key))
    # A hop's row holds its tokens plus spare columns (a quarter, at least 64), and no spare row.
    for c, held in result["kv_held_slots"].items():
        tokens = int(c) + 1 + result["evidence_tokens"]
        assert tokens <= held <= tokens + max(64, tokens // 4), (c, held)
    # Optional pieces are figures or n/a with a reason, never missing.
    assert _positive(result["rerank_ms"]) or result["na"]["rerank_ms"]
    assert result["fits_under_cap"] is None and result["na"]["fits_under_cap"]
    return result


def test_small_shapes_on_cpu():
    result = _check(_run())
    assert result["quantization"] == "none" and result["dtype"] == "float32"
    assert result["kv_bytes_per_token"] == 2 * 3 * 2 * 32 * 4  # K and V x layers x kv heads x head_dim x fp32


def test_small_shapes_in_nf4_on_cpu():
    """The layer-by-layer nf4 build the GPU run uses, at small shapes."""
    pytest.importorskip("bitsandbytes")
    result = _check(_run("--quant", "nf4"))
    assert result["quantization"] == "nf4" and result["dtype"] == "bfloat16"
    assert result["kv_bytes_per_token"] == 2 * 3 * 2 * 32 * 2


def test_sigterm_still_prints_the_sections_that_ran():
    """Stopped by ``timeout`` (the GPU check's limit), the bench prints the table and JSON of what
    it measured, with a ``stopped`` row naming the sections it did not finish, and exits 1."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "gpu.py"), "--device", "cpu"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:  # progress: one line per section
        if line.startswith("[bench/gpu] decode:"):
            proc.send_signal(signal.SIGTERM)
            break
    out, _ = proc.communicate(timeout=120)
    lines = out.strip().splitlines()
    result = json.loads(lines[-1])
    assert proc.returncode == 1 and result["complete"] is False
    assert all(v > 0 for v in result["decode_tok_s"].values())  # measured before the signal: kept
    assert "memory" in result["errors"]["stopped"] and "search_ms" not in result
    assert any(line.startswith("stopped ") for line in lines[:-1])
