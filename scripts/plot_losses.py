"""Loss curves of marker-training runs, one line per run, as a PNG (and each run's mean and spread).

    python scripts/plot_losses.py out/cmp100-loop out/cmp100-trl --out docs/img/sft-loop-vs-trl.png

Reads each run folder's ``training.json`` (``scripts/train_markers.py`` writes it): its loss figures,
one per ``log_every`` steps, drawn at the step each one ends.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def curve(run: Path) -> tuple[list[int], list[float]]:
    record = json.loads((run / "training.json").read_text())
    losses, every = record["result"]["losses"], record["config"]["log_every"]
    return [every * (i + 1) for i in range(len(losses))], losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run folders (each with a training.json)")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--labels", help="comma-separated, one per run (default: the folder names)")
    args = ap.parse_args(argv)
    runs = [Path(r) for r in args.runs]
    labels = args.labels.split(",") if args.labels else [r.name for r in runs]
    if len(labels) != len(runs):
        ap.error("--labels: one per run")
    missing = [str(r) for r in runs if not (r / "training.json").is_file()]
    if missing:
        ap.error(f"no training.json in {', '.join(missing)}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run, label in zip(runs, labels):
        steps, losses = curve(run)
        ax.plot(steps, losses, marker="o", markersize=3, label=label)
        spread = statistics.stdev(losses) if len(losses) > 1 else 0.0
        print(f"{label}: {len(losses)} figures, mean {statistics.fmean(losses):.4f}, sd {spread:.4f}, "
              f"first {losses[0]:.4f}, last {losses[-1]:.4f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over the figure's steps)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
