"""Make docs/budget-curve.png from docs/budget-curve.csv: test BLEU (test_2016_flickr, Multi30k
protocol) of `bash scripts/main_job.sh --time-budget-min M` against M, the shape rule beside
round 3's fixed recipe (two `multi30k-ensemble` members, warmup 1,600), with the published
Transformer-Tiny's 41.02 as the anchor.

    python docs/make_budget_curve.py            # reads docs/budget-curve.csv
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

HERE = Path(__file__).parent
LABELS = {"rule": "the shape rule (--ensemble auto)",
          "shape": "the shape rule before dropout followed the budget",
          "before5": "the shape rule before the checkpoints followed the budget",
          "fixed": "round 3's fixed recipe (2 x multi30k-ensemble, warmup 1,600)"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=HERE / "budget-curve.csv", type=Path)
    p.add_argument("-o", "--output", default=HERE / "budget-curve.png", type=Path)
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.data, newline="") as f:
        rows = list(csv.DictReader(f))
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    labelled: set[tuple[float, float]] = set()  # a point both recipes share is labelled once
    for cls in dict.fromkeys(r["cpu_class"] for r in rows):
        for recipe, style in (("rule", "o-"), ("shape", "^"), ("before5", "v"),
                              ("fixed", "s--")):
            pts = sorted((float(r["minutes"]), float(r["test"])) for r in rows
                         if r["cpu_class"] == cls and r["recipe"] == recipe)
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, style, label=f"{LABELS[recipe]}, {cls}")
                for x, y in sorted(set(pts) - labelled):
                    labelled.add((x, y))
                    ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(4, -12),
                                fontsize=8)
    ax.axhline(41.02, color="grey", linestyle=":", label="Transformer-Tiny, published (41.02)")
    ax.set_xscale("log")
    ticks = sorted({float(r["minutes"]) for r in rows} | {10, 20, 30, 60, 120})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.set_xlabel("training budget (minutes, --time-budget-min)")
    ax.set_ylabel("test BLEU (test_2016_flickr, Multi30k protocol)")
    ax.set_title("The main job at each budget, 2 cores")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    tmp = args.output.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    tmp.replace(args.output)
    print(args.output)


if __name__ == "__main__":
    main()
