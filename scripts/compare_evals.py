"""One table from several ``rig eval`` runs (e.g. prompt-only vs trained adapter on the same split).

    python scripts/compare_evals.py prompt-only=out/eval-prompt trained=out/eval-trained [--out docs/x.md]

Each argument is LABEL=FOLDER (a folder ``rig eval --out`` wrote); every run in its results.json
becomes a row named ``LABEL rig@3`` and so on. Prints the metrics table, the per-hop table and, last,
one JSON line with all rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rig_decode.eval.report import hops_table, markdown_table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", metavar="LABEL=FOLDER")
    ap.add_argument("--out", help="also write the tables to this Markdown file")
    args = ap.parse_args(argv)
    rows: dict[str, dict] = {}
    commands = []
    for arg in args.runs:
        label, sep, folder = arg.partition("=")
        if not sep or not label or not folder:
            ap.error(f"{arg!r}: expected LABEL=FOLDER")
        path = Path(folder) / "results.json"
        if not path.is_file():
            ap.error(f"{path} not found: run `rig eval --out {folder}` first")
        data = json.loads(path.read_text())
        commands.append(data.get("meta", {}).get("command", ""))
        for name, summary in data["runs"].items():
            rows[f"{label} {name}"] = summary
    text = "\n".join([*(f"    {c}" for c in commands if c), "", markdown_table(rows), "", hops_table(rows), ""])
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    print(json.dumps({"runs": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
