"""bench/abuse.py at a tiny size on the embedded default: the normal requests all succeed, alone and beside a
hostile client; every attack is sent and gets its expected status (no 5xx, no broken connection); /health
answers throughout; the exit code follows the verdict. The latency ratio is timing: reported, not asserted."""

import json

from .helpers import run_bench

ATTACKS = ["oversized", "big_prompt", "forged", "bad_json", "bad_types", "bad_max_tokens", "bad_temperature",
           "bad_role", "oov_token_ids", "token_ids"]


def test_abuse_bench_refuses_every_attack_and_serves_every_normal_request(real):
    proc = run_bench("abuse.py", "--requests", "4", "--clients", "2", "--hostile", "1", "--max-tokens", "8")
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode in (0, 1) and len(lines) > 1, proc.stderr[-3000:]
    result = json.loads(lines[-1])
    assert result["bench"] == "abuse"
    assert proc.returncode == (0 if result["verdict"] == "ok" else 1) and (result["verdict"] == "ok") == (
        not result["failures"]), result
    for phase in ("baseline", "abuse"):
        assert result[phase]["completed"] == result[phase]["requests"] == 4, result[phase]
        assert result[phase]["errors"] == 0, result[phase]
    abuse = result["abuse"]
    assert list(abuse["hostile_sent"]) == ATTACKS and min(abuse["hostile_sent"].values()) >= 1, abuse["hostile_sent"]
    assert abuse["unexpected"] == abuse["server_errors"] == 0, abuse["unexpected_examples"]
    assert abuse["health_polls"] > 0 and abuse["health_errors"] == 0, abuse
    # after the warm-up the server finished each request it answered 200: both phases' 4, forged, token ids
    answered = sum(abuse["hostile_statuses"][k].get("200", 0) for k in ("forged", "token_ids"))
    assert result["server_finished"] == 8 + answered and result["left_in_flight"] == 0, result
    assert all(f.startswith("p95_ratio") for f in result["failures"]), result["failures"]
