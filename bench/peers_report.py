"""What a run of ``bench/peers.py`` gives (per system and concurrency: answers, tokens, latencies,
hops) and what is reported of it: the statistics per system, the ratios rig-vllm-stream vs
resubmit-vllm, the table and the JSON record."""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from rig_decode.eval.metrics import contains_answer, percentile

sys.path.append(str(Path(__file__).resolve().parent))  # bench/, as when run as a script (the tests load this file)
from harness import Table  # noqa: E402

SYSTEMS = ("rig-hf", "rig-vllm-stream", "vllm-alone", "rig-vllm-prefix", "rig-llama", "rig-llama-lookahead",
           "resubmit-vllm", "resubmit-llama")
"""Every system, in the order the report lists them."""
REFERENCE = "rig-hf"


@dataclass
class Hop:
    question: int
    ms: float | None
    """End marker -> first token after the evidence."""
    evaluated: int | None
    """Tokens the engine evaluated to take the evidence in."""


@dataclass
class RunResult:
    system: str
    concurrency: int
    wall_s: float
    answers: list[str]
    generated: list[int]
    latency_ms: list[float]
    hops: list[Hop] = field(default_factory=list)
    retokenized: int = 0
    """Positions whose ids changed when the text was tokenised again (summed over hops)."""
    retokenized_hops: int = 0
    """Hops whose re-tokenised prompt differed anywhere from the ids the model had."""
    finish: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """Engine errors of the run's rows (a failed row's reason)."""
    calls: int | None = None
    """Requests rig's runner made of the engine it drives (a chunk, a stream, a lookahead window)."""
    decode_ms: list[float] = field(default_factory=list)
    """Per row: time spent decoding between hops (each stretch's tokens after its first)."""
    decode_tokens: list[int] = field(default_factory=list)
    """Per row: the tokens decoded in that time."""
    plans: list | None = None
    """rig's rows as ``vllm-alone`` replays them (``peers_systems.replay_plan``)."""
    tok_s_runs: list[float] | None = None
    """Each run's tokens/s, where this result combines several (``combine_runs``)."""

    @property
    def tok_s(self) -> float:
        return sum(self.generated) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float | None:
        """A row's decoding speed between hops: tokens after each stretch's first over the time they
        took, summed over rows (1 / the mean inter-token time)."""
        seconds = sum(self.decode_ms) / 1e3
        return round(sum(self.decode_tokens) / seconds, 2) if seconds > 0 else None


def combine_runs(runs: list[RunResult]) -> RunResult:
    """One system's runs at one concurrency as one: the run of median tokens/s (the lower of the two
    middle ones for an even count) with every run's hops, latencies and decoding stretches pooled, and
    each run's tokens/s kept (``tok_s_runs``)."""
    if len(runs) == 1:
        return runs[0]
    median = sorted(runs, key=lambda r: r.tok_s)[(len(runs) - 1) // 2]
    pooled = replace(median, hops=[h for r in runs for h in r.hops],
                     latency_ms=[v for r in runs for v in r.latency_ms],
                     decode_ms=[v for r in runs for v in r.decode_ms],
                     decode_tokens=[v for r in runs for v in r.decode_tokens],
                     errors=[e for r in runs for e in r.errors])
    pooled.tok_s_runs = [round(r.tok_s, 2) for r in runs]
    return pooled


def _p(values, q=50):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return round(statistics.median(values), 1) if q == 50 else round(percentile(values, q), 1)


def summarize(runs: dict[str, dict[int, RunResult]], gold: list[list[str]] | None = None,
              reference: str = REFERENCE) -> dict[str, dict]:
    out = {}
    ref_runs = runs.get(reference) or {}
    ref = ref_runs[min(ref_runs)].answers if ref_runs else None
    for name, by_c in runs.items():
        cs = sorted(by_c)
        low, high = by_c[cs[0]], by_c[cs[-1]]
        s = {"per_hop_ms": _p([h.ms for h in low.hops]),
             "hop_tokens_evaluated": _p([h.evaluated for h in low.hops]),
             **{f"tok_s_c{c}": round(by_c[c].tok_s, 2) for c in cs},
             "p95_ms": _p(high.latency_ms, 95),
             "retokenized": low.retokenized,
             "same_answers": (f"{sum(a == b for a, b in zip(low.answers, ref))}/{len(ref)}"
                              if ref is not None and low.answers else None),
             "calls": low.calls}
        for c in cs:
            r = by_c[c]
            s[f"per_hop_ms_c{c}"] = _p([h.ms for h in r.hops])
            s[f"p95_ms_c{c}"] = _p(r.latency_ms, 95)
            s[f"decode_tok_s_c{c}"] = r.decode_tok_s
            if r.tok_s_runs:
                s[f"tok_s_c{c}_runs"] = r.tok_s_runs
            if ref is not None and r.answers:
                s[f"same_answers_c{c}"] = f"{sum(a == b for a, b in zip(r.answers, ref))}/{len(ref)}"
        s["retokenized_hops"] = low.retokenized_hops
        s["hops"] = len(low.hops)
        evaluated = [h.evaluated for h in low.hops if h.evaluated is not None]
        s["hop_tokens_evaluated_mean"] = round(statistics.mean(evaluated), 1) if evaluated else None
        s["generated_tokens"] = sum(low.generated)
        if gold is not None and low.answers:
            s["accuracy"] = round(statistics.mean(contains_answer(a, g) for a, g in zip(low.answers, gold)), 3)
        s["finish"] = {k: low.finish.count(k) for k in sorted(set(low.finish))}
        errors = [e for c in cs for e in by_c[c].errors]
        if errors:
            s["errors"] = errors[:3]
        out[name] = s
    return out


PAIRS = {"ratios": ("rig-vllm-stream", "resubmit-vllm"), "ratios_llama": ("rig-llama", "resubmit-llama")}
"""Result keys of rig's ratios against the resubmit loop, on each engine."""
ALONE = ("rig-vllm-stream", "vllm-alone")
"""rig's decoding between hops against vLLM decoding the same rows alone (``decode_vs_alone``)."""


def decode_vs_alone(summary: dict[str, dict], concurrency: list[int]) -> dict:
    a, b = summary.get(ALONE[0]) or {}, summary.get(ALONE[1]) or {}
    out = {}
    for c in concurrency:
        x, y = a.get(f"decode_tok_s_c{c}"), b.get(f"decode_tok_s_c{c}")
        out[f"c{c}"] = round(x / y, 3) if x and y else None
    return out


def ratios(summary: dict[str, dict], concurrency: list[int], rig: str = "rig-vllm-stream",
           peer: str = "resubmit-vllm") -> dict:
    """How many times faster rig is than the resubmit loop at each concurrency: per hop (p50) and end
    to end (tokens/s)."""
    a, b = summary.get(rig) or {}, summary.get(peer) or {}
    out = {}
    for c in concurrency:
        x, y = a.get(f"per_hop_ms_c{c}"), b.get(f"per_hop_ms_c{c}")
        out[f"per_hop_c{c}"] = round(y / x, 2) if x and y else None
    for c in concurrency:
        x, y = a.get(f"tok_s_c{c}"), b.get(f"tok_s_c{c}")
        out[f"end_to_end_c{c}"] = round(x / y, 2) if x and y else None
    for c in concurrency:  # run by run (the runs were interleaved: run i of each ran side by side)
        xs, ys = a.get(f"tok_s_c{c}_runs"), b.get(f"tok_s_c{c}_runs")
        if xs and ys and len(xs) == len(ys):
            out[f"end_to_end_c{c}_runs"] = [round(x / y, 2) if y else None for x, y in zip(xs, ys)]
    return out


def _fmt(v) -> str:
    return "-" if v is None else f"{v:g}" if isinstance(v, (int, float)) else str(v)


def print_report(result: dict, out=None) -> None:
    cs = result["concurrency"]
    hi = max(cs)
    print(f"{result['questions']} questions (>= {result['min_hops']} gold hops) of {result['dataset']}, "
          f"+{result['search_ms']:g} ms per search call, max_iterations {result['max_iterations']}, "
          f"{result['max_tokens']} tokens max, model {result['model']}", file=out)
    cols = ([("hop ms", "per_hop_ms")] + [(f"hop ms c{c}", f"per_hop_ms_c{c}") for c in cs if c != min(cs)]
            + [("hop eval", "hop_tokens_evaluated"), ("hops", "hops")]
            + [(f"tok/s c{c}", f"tok_s_c{c}") for c in cs]
            + [(f"dec/s c{c}", f"decode_tok_s_c{c}") for c in cs]
            + [(f"p95 ms c{hi}", "p95_ms"), ("calls", "calls"), ("retok", "retokenized"),
               ("same ans", "same_answers"), ("acc", "accuracy")])
    table = Table(("system", "<"), *((h, _fmt) for h, _ in cols))
    for name, s in result["systems"].items():
        if "skipped" in s or "error" in s:
            table.add(name, f"{'skipped' if 'skipped' in s else 'error'}: {s.get('skipped') or s.get('error')}")
        else:
            table.add(name, *(s.get(k) for _, k in cols))
    table.print(out)
    for key, (rig, peer) in PAIRS.items():
        r = result.get(key) or {}
        if any(v is not None for v in r.values()):
            per_hop = ", ".join(f"c{c} {_fmt(r.get(f'per_hop_c{c}'))}x" for c in cs)
            end = ", ".join(f"c{c} {_fmt(r.get(f'end_to_end_c{c}'))}x" for c in cs)
            print(f"{rig} vs {peer}: per hop {per_hop} faster; tokens/s {end}", file=out)
            by_run = [f"c{c} " + " ".join(f"{_fmt(v)}x" for v in r[f"end_to_end_c{c}_runs"])
                      for c in cs if r.get(f"end_to_end_c{c}_runs")]
            if by_run:
                print(f"  tokens/s run by run: {'; '.join(by_run)}", file=out)
    alone = result.get("decode_vs_alone") or {}
    if any(v is not None for v in alone.values()):
        print(f"{ALONE[0]} decoding between hops vs {ALONE[1]} on the same rows: "
              + ", ".join(f"c{c} {_fmt(alone.get(f'c{c}'))}x" for c in cs), file=out)


def result_json(summary: dict, skipped: dict[str, str], errors: dict[str, str], concurrency: list[int],
                **config) -> dict:
    systems = dict(summary)
    for name, why in skipped.items():
        systems[name] = {"skipped": why}
    for name, why in errors.items():
        systems.setdefault(name, {})["error"] = why
    order = {n: i for i, n in enumerate(SYSTEMS)}
    systems = dict(sorted(systems.items(), key=lambda kv: order.get(kv[0], len(order))))
    return {"bench": "peers", **config, "concurrency": concurrency, "systems": systems,
            **{key: ratios(summary, concurrency, rig, peer) for key, (rig, peer) in PAIRS.items()},
            "decode_vs_alone": decode_vs_alone(summary, concurrency)}
