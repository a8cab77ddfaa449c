"""The table and JSON of ``bench/gpu.py``: rows grouped by section, each figure also under its key,
``None`` with a reason where a figure does not apply, and the sections that failed."""

from __future__ import annotations

from harness import Table  # bench/ is on sys.path when run as a script


class Report:
    """Table rows in order, and the same figures for the JSON line (``None`` + reason when n/a)."""

    def __init__(self):
        self.rows: list[tuple] = []  # (section, metric, value, unit), or (section, metric, note)
        self.data: dict = {}
        self.na: dict[str, str] = {}
        self.errors: dict[str, str] = {}

    def add(self, section: str, metric: str, value, unit: str, key: str, sub=None) -> None:
        self.rows.append((section, metric, value, unit))
        self._put(key, sub, value)

    def line(self, section: str, metric: str, value, unit: str = "") -> None:
        """A table row only (its figures are in the JSON under a key of their own)."""
        self.rows.append((section, metric, value, unit))

    def decode(self, result: dict, quant: str, layers: int, of: int) -> None:
        """The rows of ``decode_step.py --shapes``'s JSON for one weight format."""
        self.line("decode", f"{quant}: copy bandwidth measured", result["bandwidth_gbs"], "GB/s (read + write)")
        self.line("decode", f"{quant}: layers built", f"{layers} of {of}",
                  "(tokens/s of that many layers; all of them reach at least their % of the bound)")
        for row in result["rows"]:
            what = f"{row['setup']}, batch {row['batch']} ({row['context']} ctx)"
            self.line("decode", what, row["tok_s"], f"tokens/s ({row['pct_of_bound']:.0f}% of the bound, "
                      f"{row['bound_tok_s']:,.0f})")
            if "same_tokens" in row and not row["setup"].endswith(" hf"):
                self.line("decode", f"{what}: greedy tokens = hf's", bool(row["same_tokens"]))
        decode = self.data.setdefault("decode", {"layers": layers, "bandwidth_gbs": {}, "rows": []})
        decode["bandwidth_gbs"][quant] = result["bandwidth_gbs"]
        decode["rows"] += result["rows"]

    def long_prefill(self, result: dict) -> str | None:
        """The rows of ``prefill_cap.py``'s JSON; what failed where chunks ran out of memory (None:
        nothing; one forward running out of memory is a finding, not a failure)."""
        failed = None
        for row in result["rows"]:
            chunk = row["chunk"]
            what = f"{result['context']} tokens, " + ("one forward" if chunk is None else f"chunks of {chunk}")
            if not row["ok"]:
                self.line("long prefill", what, "out of memory", f"under the cap: {row['error'][:80]}")
                failed = failed or (f"{what}: {row['error']}" if chunk is not None else None)
                continue
            self.line("long prefill", what, row["ms"], "ms")
            if "peak_card_gib" in row:
                self.line("long prefill", f"{what}: card peak", row["peak_card_gib"],
                          f"GiB (activations {row['activation_peak_gib']:.2f}, KV {row['kv_gib']:.2f}, weights "
                          f"{row['weights_gib']:.2f}); fits the cap: {'yes' if row['fits_cap'] else 'no'}")
        if result["compared"]:
            self.line("long prefill", "chunked vs one forward: same next token", result["compared"]["same_argmax"],
                      f"(max |logit diff| {result['compared']['max_abs_diff']:.3g})")
        self.data["long_prefill"] = {k: v for k, v in result.items() if k != "bench"}
        return failed

    def missing(self, section: str, metric: str, key: str, reason: str, sub=None) -> None:
        short = reason if len(reason) <= 100 else reason[:99] + "…"  # the JSON keeps it whole
        self.rows.append((section, metric, f"n/a ({short})"))
        self._put(key, sub, None)
        self.na[key if sub is None else f"{key}.{sub}"] = reason

    def syncs(self, section: str, label: str, count: int | None, key: str, context: int) -> None:
        """The device syncs in one hop (where its host side waits for the GPU), or n/a off CUDA."""
        metric = f"device syncs in one {label}, {context} ctx"
        if count is None:
            self.missing(section, metric, key, "counted on cuda only", context)
        else:
            self.add(section, metric, count, "syncs", key, context)

    def _put(self, key: str, sub, value) -> None:
        if sub is None:
            self.data[key] = value
        else:
            self.data.setdefault(key, {})[str(sub)] = value

    def failed(self, section: str, error: str) -> None:
        self.rows.append((section, "error", error))
        self.errors[section] = error

    def print(self, sections: tuple[str, ...]) -> None:
        """The rows grouped by section, in the order of ``sections`` (a row's section starts with its name)."""
        def rank(row) -> int:
            return next((i for i, name in enumerate(sections) if row[0].startswith(name)), len(sections))

        table = Table(("section", "<"), ("metric", "<"), ("value", _value), ("unit", "<"))
        for row in sorted(self.rows, key=rank):  # stable within a section
            table.add(*row)
        table.print()


def _value(v) -> str:
    """A figure as the table shows it: yes/no, thousands separated, 1 to 3 decimals by magnitude."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.3f}" if abs(v) < 1 else f"{v:.2f}"
    return str(v)
