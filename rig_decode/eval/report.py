"""Eval outputs: a Markdown table (stdout and report.md), results.json, traces.jsonl and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

from .runner import APPROXIMATIONS, RunKey, aggregate


def _pct(v):
    return "-" if v is None else f"{100 * v:.1f}"


def _num(fmt):
    return lambda v: "-" if v is None else format(v, fmt)


COLUMNS = [
    ("n", "n", _num("d")),
    ("exact_match", "EM %", _pct),
    ("f1", "F1 %", _pct),
    ("accuracy", "acc %", _pct),
    ("retrieval_precision", "ret. prec. %", _pct),
    ("support_recall", "sup. recall %", _pct),
    ("hops_per_question", "hops/q", _num(".2f")),
    ("unnecessary_retrieval_rate", "unneeded ret. %", _pct),
    ("marker_validity", "marker valid %", _pct),
    ("engine_error_rate", "engine err. %", _pct),
    ("token_overhead", "token overhead", _num(".2f")),
    ("total_tokens_per_question", "tokens/q", _num(".0f")),
    ("evidence_kept_per_question", "evidence kept/q", _num(".0f")),
    ("splice_ms_per_hop", "splice ms/hop", _num(".0f")),
    ("latency_p50_ms", "p50 ms", _num(".0f")),
    ("latency_p95_ms", "p95 ms", _num(".0f")),
    ("wall_s", "wall s", _num(".1f")),
    ("source_claims_without_hop", "src claim w/o hop %", _pct),
]


def markdown_table(summary: dict[str, dict]) -> str:
    head = "| method | " + " | ".join(c[1] for c in COLUMNS) + " |"
    sep = "|---|" + "---:|" * len(COLUMNS)
    rows = [f"| {label} | " + " | ".join(fmt(m.get(key)) for key, _, fmt in COLUMNS) + " |"  # "-": an older run lacks it
            for label, m in summary.items()]
    return "\n".join([head, sep, *rows])


def hops_table(summary: dict[str, dict]) -> str:
    hop_counts = sorted({h for m in summary.values() for h in m["accuracy_by_hops"]}, key=int)
    if not hop_counts:
        return ""
    head = "| method | " + " | ".join(f"EM % @ {h} hops | acc % @ {h} hops" for h in hop_counts) + " |"
    sep = "|---|" + "---:|" * 2 * len(hop_counts)
    rows = [f"| {label} | " + " | ".join(f"{_pct(m.get('exact_match_by_hops', {}).get(h))} | "
                                         f"{_pct(m['accuracy_by_hops'].get(h))}" for h in hop_counts) + " |"
            for label, m in summary.items()]
    return "\n".join([head, sep, *rows])


def compare_rig_modes(results: dict[RunKey, dict]) -> dict[str, dict]:
    """For each max_iterations run by both: are the answers identical, and how much faster is rig?"""
    out = {}
    for key, res in results.items():
        if key.method != "rig":
            continue
        ref = results.get(RunKey("rig-reprefill", key.max_iterations))
        if ref is None:
            continue
        a = {r["id"]: r["prediction"] for r in res["records"]}
        b = {r["id"]: r["prediction"] for r in ref["records"]}
        out[str(key.max_iterations)] = {
            "identical_answers": a == b,
            "differing": sorted(i for i in a if a[i] != b.get(i)),
            "speedup": ref["wall_s"] / res["wall_s"] if res["wall_s"] else None,
        }
    return out


def compare_variants(results: dict[RunKey, dict]) -> dict[str, dict]:
    """The variants that approximate ``rig`` (``APPROXIMATIONS``: summary, zero-prefill): per hop
    budget run by both, the share of identical answers and the accuracy change."""
    out = {}
    for key, res in results.items():
        ref = results.get(RunKey("rig", key.max_iterations))
        if key.method not in APPROXIMATIONS or ref is None:
            continue
        a = {r["id"]: r for r in res["records"]}
        b = {r["id"]: r for r in ref["records"]}
        same = sum(a[i]["prediction"] == b[i]["prediction"] for i in a if i in b)
        out[key.label] = {
            "same_answers": same / len(a) if a else None,
            "accuracy_delta": (sum(r["accuracy"] for r in a.values()) - sum(r["accuracy"] for r in b.values())) / len(a)
            if a else None,
        }
    return out


def plot(summary: dict[str, dict], keys: list[RunKey], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for metric, ylabel, fname in (("accuracy", "accuracy (%)", "accuracy_vs_max_iterations.png"),
                                  ("latency_p50_ms", "p50 latency (ms)", "latency_vs_max_iterations.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        scale = 100 if metric == "accuracy" else 1
        for method in dict.fromkeys(k.method for k in keys):
            pts = [(k.max_iterations, summary[k.label][metric]) for k in keys if k.method == method]
            if pts[0][0] is None:  # none / rag: no hop budget, a horizontal reference line
                ax.axhline(pts[0][1] * scale, linestyle="--", label=method,
                           color="grey" if method == "none" else "tab:green")
            else:  # rig-reprefill has rig's answers: draw it so that both lines stay visible
                style = dict(marker="s", linestyle=":", markersize=8, fillstyle="none") \
                    if method == "rig-reprefill" else dict(marker="o")
                ax.plot([p[0] for p in pts], [p[1] * scale for p in pts], label=method, **style)
        ax.set_xticks(sorted({k.max_iterations for k in keys if k.max_iterations is not None}))
        ax.set_ylim(bottom=0)
        ax.set_xlabel("max_iterations")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def write_outputs(out_dir: str | Path, results: dict[RunKey, dict], keys: list[RunKey], meta: dict) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = {k.label: aggregate(results[k]["records"], results[k]["wall_s"]) for k in keys}
    modes = compare_rig_modes(results)
    variants = compare_variants(results)
    with (out / "traces.jsonl").open("w", encoding="utf-8") as f:
        for k in keys:
            for r in results[k]["records"]:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    data = {"meta": meta, "runs": summary, "rig_vs_reprefill": modes, "variants_vs_rig": variants}
    (out / "results.json").write_text(json.dumps(data, indent=1, ensure_ascii=False))
    plots = plot(summary, keys, out)
    table = markdown_table(summary)
    lines = [f"# rig eval: {meta.get('dataset')}", "", f"`{meta.get('command')}`", "",
             f"model `{meta.get('model')}`, {meta.get('examples')} questions, corpus: {meta.get('corpus')}", "",
             table, "", hops_table(summary), ""]
    for mi, c in modes.items():
        lines.append(f"- rig vs rig-reprefill @ max_iterations={mi}: identical answers: {c['identical_answers']}, "
                     f"rig {c['speedup']:.2f}x faster (wall time)")
    for label, c in variants.items():
        lines.append(f"- {label} vs rig: {_pct(c['same_answers'])}% identical answers, accuracy "
                     f"{100 * c['accuracy_delta']:+.1f} points")
    lines += ["", *[f"![{p.stem}]({p.name})" for p in plots], ""]
    (out / "report.md").write_text("\n".join(lines))
    return data
