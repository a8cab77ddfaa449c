"""bench/splice.py and bench/decode_step.py at tiny sizes on the embedded default: they drive the
runner directly (cropping, re-prefilling, packed steps), so a runner change that breaks them fails
here rather than in the next benchmark run. Each prints a table, then one JSON line."""

from .helpers import bench_output, run_bench


def _bench(script: str, *args: str) -> dict:
    return bench_output(run_bench(script, *args))[1]


def test_splice_bench(real):
    result = _bench("splice.py", "--contexts", "64,128", "--evidence", "32", "--repeats", "1")
    assert [r["context"] for r in result["rows"]] == [64, 128]
    for r in result["rows"]:
        assert r["new_tokens"] == 33  # the marker's end token and the evidence block
        assert all(r[k] > 0 for k in ("splice_ms", "floor_ms", "reprefill_ms", "no_ctx_ms")), r


def test_decode_step_bench_set_ups_compute_the_same(real):
    """The HF modules and the graph (eager: no compile in CI) pick the same tokens; every row is
    measured below its bandwidth bound."""
    result = _bench("decode_step.py", "--batches", "1,2", "--contexts", "32", "--steps", "2",
                    "--setups", "int8 hf,int8 graph")
    assert [(r["setup"], r["batch"], r["context"]) for r in result["rows"]] == [
        ("int8 hf", 1, 32), ("int8 graph", 1, 32), ("int8 hf", 2, 32), ("int8 graph", 2, 32)]
    assert result["bandwidth_gbs"] > 0
    for r in result["rows"]:
        assert r["same_tokens"], r
        assert r["ms"] > 0 and 0 < r["pct_of_bound"] <= 100 and r["weight_mib"] > 0, r


def test_chaos_bench_serves_every_request_and_records_every_fault(real):
    """bench/chaos.py at a small size: half the searches faulty, every mode possible."""
    result = _bench("chaos.py", "--requests", "8", "--clients", "4", "--fault-rate", "0.5", "--timeout-s", "1",
                    "--hang-s", "3", "--max-tokens", "24")
    assert result["completed"] == 8 and result["lost"] == result["hung"] == result["duplicate_ids"] == 0, result
    assert result["faults_injected"] > 0 and result["faults_recorded"] == result["faults_injected"], result
    assert result["clean_request_evidence"] and result["retrieval_after"] == "ok", result
    assert result["left_in_flight"] == 0 and result["server_finished"] == 9, result
