"""Plot eviction_policies.py output: misses per step and hit rate against the cache budget."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("jsonl", nargs="?", default="results/eviction_policies.jsonl")
    parser.add_argument("--out", default="results/eviction_policies.png")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = defaultdict(list)
    with open(args.jsonl) as f:
        for line in f:
            row = json.loads(line)
            series[row["policy"]].append(row)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for policy, rows in sorted(series.items()):
        rows.sort(key=lambda r: r["hot_slots"])
        budget = [r["hot_slots"] for r in rows]
        left.plot(budget, [r["misses_per_request_group_step"] for r in rows], "o-", label=policy)
        right.plot(budget, [r["hit_rate"] for r in rows], "o-", label=policy)
    for ax, label in ((left, "misses / request / group / step"), (right, "hit rate")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("hot-cache slots C")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    first = next(iter(series.values()))[0]
    fig.suptitle(f"{first['model']}: batch {first['batch']}, W {first['ways']}, context "
                 f"{first['context']}, heavy fraction {first['heavy']}")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
