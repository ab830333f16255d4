"""Plot replay.py output: per trace, hit rate and copies relative to Belady against C / k."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("jsonl", nargs="?", default="results/replay.jsonl")
    parser.add_argument("--out", default="results/replay.png")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_trace = defaultdict(lambda: defaultdict(list))
    with open(args.jsonl) as f:
        for line in f:
            row = json.loads(line)
            if row.get("question") == "replay":
                by_trace[row["trace"]][row["policy"]].append(row)
    if not by_trace:
        raise SystemExit(f"{args.jsonl} holds no replay rows (question == 'replay')")
    fig, axes = plt.subplots(len(by_trace), 2, figsize=(11, 3.6 * len(by_trace)),
                             squeeze=False)
    for (name, series), (left, right) in zip(sorted(by_trace.items()), axes):
        for policy, rows in sorted(series.items()):
            rows.sort(key=lambda r: r["multiple"])
            budget = [r["multiple"] for r in rows]
            style = "k--" if policy == "belady" else "o-"
            left.plot(budget, [r["hit_rate"] for r in rows], style, label=policy)
            right.plot(budget, [r["ratio_to_belady"] for r in rows], style, label=policy)
        first = next(iter(series.values()))[0]
        for ax, label in ((left, "hit rate"), (right, "copies / Belady's")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("hot-cache slots C / k")
            ax.set_ylabel(label)
            ax.set_title(f"{name} (k {first['topk']}, W {first['ways']})", fontsize=9)
            ax.grid(alpha=0.3)
        left.axhline(0.97, color="grey", lw=0.8)
        right.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
