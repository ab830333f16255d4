"""Plot decode_bench.py output: management time per step against C, ring vs LRU."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("jsonl", nargs="?", default="results/decode_bench.jsonl")
    parser.add_argument("--out", default="results/decode_bench.png")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = defaultdict(dict)  # policy -> {C: (ratio, q25, q75)} (the last run wins)
    meta = None
    with open(args.jsonl) as f:
        for line in f:
            row = json.loads(line)
            if row["question"] == "management":
                ratio = row["ratio"]
                series[row["policy"]][row["hot_slots"]] = (
                    ratio, row.get("ratio_q25", ratio), row.get("ratio_q75", ratio))
                meta = row
    if meta is None:
        raise SystemExit(f"{args.jsonl} holds no management rows")
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, points in sorted(series.items()):
        sizes = sorted(points)
        mid = [points[c][0] for c in sizes]
        spread = [[m - points[c][1] for c, m in zip(sizes, mid)],
                  [points[c][2] - m for c, m in zip(sizes, mid)]]
        ax.errorbar(sizes, mid, yerr=spread, fmt="o-", capsize=3,
                    label=f"{policy} (median, IQR)")
    ax.axhline(1.15, color="grey", lw=0.8, ls="--", label="1.15x")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("hot-cache slots C")
    ax.set_ylabel("management time / time at smallest C (per round)")
    ax.set_title(f"k={meta['k']}, W={meta['ways']}, batch {meta['batch']}, "
                 f"context {meta['context']} ({meta['backend']})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
