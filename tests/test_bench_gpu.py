"""bench/gpu.py at its small CPU shapes: every section runs, the table comes first, the JSON last; the
benchmarks it runs in processes of their own get the command lines they take; scripts/gpu_check.sh
plans its steps inside its time budget, stops at once without CUDA, and runs on the CPU when told."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from .helpers import ROOT, bench_output, run_bench

sys.path.append(str(ROOT / "bench"))  # as when a benchmark runs as a script: its siblings import by name
import gpu  # noqa: E402
from gpu_report import Report  # noqa: E402

CHECK = ROOT / "scripts" / "gpu_check.sh"
CHECK_ENV = {**os.environ, "PYTHON": sys.executable}  # the check runs this interpreter


def _run(*args: str) -> subprocess.CompletedProcess:
    return run_bench("gpu.py", "--device", "cpu", *args, timeout=300)


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _check(lines: list[str], result: dict) -> dict:
    assert lines[0].split() == ["section", "metric", "value", "unit"]
    table = "\n".join(lines)
    for section in ("decode", "long prefill", "evidence prefill", "hop", "zero-prefill", "evict", "search", "rerank",
                    "memory"):
        assert f"\n{section} " in table, section

    assert result["bench"] == "gpu" and result["device"] == "cpu" and result["shapes"] == "small"
    assert result["errors"] == {} and result["complete"] is True
    contexts = [str(c) for c in result["contexts"]]
    assert contexts == ["256", "512"]
    # Decode: eager vs the uncompiled graph step on CPU, batch 1 and 8, each beside its bound.
    quant, decode = result["quantization"], result["decode"]
    assert result["decode_steps"] == "hf,graph" and decode["layers"] == 3
    assert {(r["setup"], r["batch"]) for r in decode["rows"]} == {(f"{quant} {s}", b) for s in ("hf", "graph")
                                                                  for b in (1, 8)}
    for r in decode["rows"]:
        assert _positive(r["tok_s"]) and _positive(r["bound_tok_s"]) and r["context"] == 64
        assert r["pct_of_bound"] == pytest.approx(100 * r["tok_s"] / r["bound_tok_s"], abs=0.1)
    assert _positive(decode["bandwidth_gbs"][quant])
    # The long prefill, chunked and in one forward: both run, and agree.
    prefill = result["long_prefill"]
    assert prefill["context"] == 512 and prefill["quantization"] == quant
    assert [(r["chunk"], r["ok"]) for r in prefill["rows"]] == [(64, True), (None, True)]
    assert prefill["compared"]["same_argmax"] is True
    for key in ("splice_ms", "reprefill_ms", "reprefill_over_splice", "zero_prefill_ms", "zero_prefill_deviation_ms",
                "zero_prefill_host_ms", "evidence_prefill_tok_s"):
        assert set(result[key]) == set(contexts), key
        assert all(_positive(v) for v in result[key].values()), (key, result[key])
    for key in ("cold_pieces_each_ms", "cold_pieces_packed_ms", "evict_ms", "search_ms", "weights_gb", "index_gb",
                "kv_bytes_per_token", "planned_max_kv_tokens", "peak_gb", "cap_gb"):
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
    result = _check(*bench_output(_run()))
    assert result["quantization"] == "none" and result["dtype"] == "float32"
    assert result["kv_bytes_per_token"] == 2 * 3 * 2 * 32 * 4  # K and V x layers x kv heads x head_dim x fp32


def test_small_shapes_in_nf4_on_cpu():
    """The layer-by-layer nf4 build the GPU run uses, at small shapes."""
    pytest.importorskip("bitsandbytes")
    result = _check(*bench_output(_run("--quant", "nf4")))
    assert result["quantization"] == "nf4" and result["dtype"] == "bfloat16"
    assert result["kv_bytes_per_token"] == 2 * 3 * 2 * 32 * 2


def test_the_check_runs_the_bench_in_int4_on_the_cpu(tmp_path):
    """``GPU_CHECK_DEVICE=cpu``: the check's own steps and logs, the bench at small shapes in int4 (the
    format it runs on the card), the steps that need CUDA skipped without failing the check."""
    proc = subprocess.run([str(CHECK), str(tmp_path)], env={**CHECK_ENV, "GPU_CHECK_DEVICE": "cpu"}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    summary = {line.split()[0]: line.split()[1] for line in (tmp_path / "summary.txt").read_text().splitlines()[1:]}
    assert summary == {"env": "ok", "triton": "skipped", "bench": "ok", "native": "skipped", "kernels": "skipped",
                       "tests": "skipped"}
    lines = (tmp_path / "bench.txt").read_text().strip().splitlines()
    result = _check(lines[:-1], json.loads(lines[-1]))
    assert result["quantization"] == "int4" and result["dtype"] == "float32"
    assert "[bench/gpu] running decode_step.py" in (tmp_path / "bench.log").read_text()
    assert proc.stdout.rstrip().endswith(lines[-1])  # the table and JSON printed after the summary


def test_sigterm_still_prints_the_sections_that_ran():
    """Stopped by ``timeout`` (the GPU check's limit), the bench prints the table and JSON of what
    it measured, with a ``stopped`` row naming the sections it did not finish, and exits 1."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "gpu.py"), "--device", "cpu"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:  # progress: one line per section
        if line.startswith("[bench/gpu] decode none:"):
            proc.send_signal(signal.SIGTERM)
            break
    out, _ = proc.communicate(timeout=120)
    lines = out.strip().splitlines()
    result = json.loads(lines[-1])
    assert proc.returncode == 1 and result["complete"] is False
    assert all(r["tok_s"] > 0 for r in result["decode"]["rows"])  # measured before the signal: kept
    assert "memory" in result["errors"]["stopped"] and "search_ms" not in result
    assert any(line.startswith("stopped ") for line in lines[:-1])


def _card_run(**kw) -> "gpu.Run":
    """The run gpu.py makes on a CUDA card at 32B shapes (nothing touches a card to make it)."""
    return gpu.Run("qwen2.5-32b", torch.device("cuda"), "int4", torch.bfloat16, Report(), "hf,compiled", 16, **kw)


def test_on_a_card_decode_compares_int4_with_nf4_where_bitsandbytes_is(monkeypatch):
    run = _card_run()
    assert run.decode_command("int4") == [
        "decode_step.py", "--shapes", "qwen2.5-32b", "--device", "cuda", "--quant", "int4", "--cap-gib", "24",
        "--layers", "16", gpu.STEP_KINDS, "hf,compiled", "--batches", "1,8", "--contexts", "1024", "--steps", "10"]
    assert run.prefill_command() == ["prefill_cap.py", "--shapes", "qwen2.5-32b", "--device", "cuda", "--quant",
                                     "int4", "--cap-gib", "24", "--context", "8192", "--chunks", "512,none"]
    monkeypatch.setattr(gpu, "has_bitsandbytes", lambda: False)
    assert run.decode_quants() == ["int4"]
    assert [name for name, _, _ in run.sections()][:2] == ["decode int4", "long prefill"]  # before the model
    monkeypatch.setattr(gpu, "has_bitsandbytes", lambda: True)
    assert run.decode_quants() == ["int4", "nf4"]
    all_layers = gpu.Run("qwen2.5-32b", torch.device("cuda"), "int4", torch.bfloat16, Report(), "hf", None)
    assert "--layers" not in all_layers.decode_command("int4")


@pytest.mark.parametrize("script", ["decode_step.py", "prefill_cap.py"])
def test_the_benchmarks_take_every_flag_the_driver_passes(script):
    """The flags of the driver's command lines are the benchmark's own (its --help names each), and
    its --quant takes int4 and nf4: a renamed flag fails here, not on the card."""
    command = _card_run().decode_command("nf4") if script == "decode_step.py" else _card_run().prefill_command()
    assert command[0] == script
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    offered = set(re.findall(r"--[a-z][a-z-]*", proc.stdout))
    assert {a for a in command if a.startswith("--")} <= offered
    assert re.search(r"--quant \{[^}]*\bint4\b[^}]*\}", proc.stdout) and "nf4" in proc.stdout


def _dry_run(tmp_path, **env) -> list[tuple[str, int | None, str]]:
    proc = subprocess.run([str(CHECK), "--dry-run", str(tmp_path / "out")], env={**CHECK_ENV, **env},
                          capture_output=True, text=True, timeout=60)
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
    steps = []
    for line in proc.stdout.splitlines()[1:]:
        if m := re.match(r"(\w+) limit (\d+)s: (.*)", line):
            steps.append((m[1], int(m[2]), m[3]))
        else:
            steps.append((line.split()[0], None, line))  # skipped
    return steps


def test_the_checks_steps_fit_480_s_even_if_each_takes_its_whole_limit(tmp_path):
    steps = _dry_run(tmp_path)
    assert [name for name, _, _ in steps] == ["env", "triton", "bench", "native", "kernels", "tests"]
    ran = [(name, limit, cmd) for name, limit, cmd in steps if limit is not None]
    assert sum(limit + 5 for _, limit, _ in ran) <= 480  # 5 s each for a step stopped at its limit to exit
    bench = dict((name, cmd) for name, _, cmd in ran)["bench"]
    assert "bench/gpu.py --device cuda --quant int4" in bench and "--decode-layers" not in bench
    assert all("no time left" in cmd for name, limit, cmd in steps if limit is None)
    # Told more layers and another format, the bench gets them; a smaller budget cuts from the end.
    steps = _dry_run(tmp_path, DECODE_LAYERS="64", QUANT="nf4", TOTAL_S="200")
    bench = next(cmd for name, _, cmd in steps if name == "bench")
    assert "--quant nf4 --decode-layers 64" in bench
    assert [limit for _, limit, _ in steps][:3] == [30, 30, 200 - 35 - 35 - 5]
    assert all(limit is None for _, limit, _ in steps[3:])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_the_check_stops_at_once_without_cuda(tmp_path):
    proc = subprocess.run([str(CHECK), str(tmp_path / "out")], env=CHECK_ENV, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr and "GPU_CHECK_DEVICE=cpu" in proc.stderr
    assert proc.stdout == "" and not (tmp_path / "out").exists()
