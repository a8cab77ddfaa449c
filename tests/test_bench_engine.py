"""bench/engine.py at a tiny workload: every concurrency row and the sync comparison run the same
tokens and hops, the table comes first, the JSON last, and the plot is written."""

from .helpers import bench_output, run_bench


def test_engine_bench_runs_the_same_work_at_every_concurrency(real, tmp_path):
    png = tmp_path / "engine.png"
    lines, result = bench_output(run_bench("engine.py", "--requests", "4", "--concurrency", "1,4", "--max-new-tokens", "96",
                                           "--retrieval-latency-ms", "0", "--sync-at", "4", "--plot", str(png)))
    assert lines[1].split()[:3] == ["concurrency", "retrieval", "tokens/s"]
    rows = result["rows"]
    assert [(r["concurrency"], r["sync_retrieval"]) for r in rows] == [(1, False), (4, False), (4, True)]
    for r in rows:  # requests hop 0, 1, 2 and 3 times and all write their 96 tokens
        assert (r["tokens"], r["hops"]) == (4 * 96, 6), r
        assert r["tokens_per_s"] > 0 and 0 < r["p50_ms"] <= r["p95_ms"]
    assert rows[0]["steps"] == 4 * 96 and rows[1]["steps"] < rows[0]["steps"]
    assert result["speedup_c8_vs_c1"] is None  # no concurrency-8 row in this run
    assert result["async_vs_sync_at_c4"] == round(rows[1]["tokens_per_s"] / rows[2]["tokens_per_s"], 2)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
