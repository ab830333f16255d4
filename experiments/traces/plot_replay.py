"""Plot replay.py output: per trace, hit rate and copies relative to Belady against C / k.

A synthetic workload generated with a recorded trace's shape (replay.py --like; named
"synthetic:KIND~TRACE") is drawn in a third panel of that trace's row, beside the trace's own
curves (policy --compare, default ring, and Belady), instead of a row of its own. --traces
keeps only the rows of the named traces (substrings). --table prints, instead of plotting, a
Markdown table per kept trace: hit rate and copies relative to Belady per policy and C / k.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def markdown_table(name: str, series: dict) -> str:
    """Hit rate (copies / Belady's) per policy (rows) and C / k (columns); misses per request
    per group per step and H2D bytes per token of the ring and belady rows below."""
    budgets = sorted({r["multiple"] for rows in series.values() for r in rows})
    first = next(iter(series.values()))[0]
    lines = [f"{name.split('/')[-1]}: k {first['topk']}, W {first['ways']}, G {first['groups']}, "
             f"B {first['batch']}, {first['steps']} steps after {first['context']} tokens",
             "", "| policy | " + " | ".join(f"C = {m} k" for m in budgets) + " |",
             "|---" * (len(budgets) + 1) + "|"]
    order = ["belady"] + sorted(p for p in series if p != "belady")
    for policy in order:
        cells = {r["multiple"]: r for r in series.get(policy, [])}
        lines.append(f"| {policy} | " + " | ".join(
            f"{cells[m]['hit_rate']:.3f} ({cells[m]['ratio_to_belady']:.2f}x)" if m in cells
            else "-" for m in budgets) + " |")
    for policy in ("ring", "belady"):
        cells = {r["multiple"]: r for r in series.get(policy, [])}
        lines.append(f"| {policy}: misses / req / group / step; H2D KB / token | " + " | ".join(
            f"{cells[m]['misses_per_request_group_step']:.1f}; "
            f"{cells[m]['h2d_bytes_per_token'] / 1024:.0f}" if m in cells else "-"
            for m in budgets) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("jsonl", nargs="?", default="results/replay.jsonl")
    parser.add_argument("--out", default="results/replay.png")
    parser.add_argument("--traces", nargs="*", default=None,
                        help="plot only traces whose name contains one of these")
    parser.add_argument("--compare", default="ring",
                        help="the policy of the real-vs-synthetic panel")
    parser.add_argument("--table", action="store_true", help="print Markdown tables, no plot")
    args = parser.parse_args(argv)
    by_trace = defaultdict(lambda: defaultdict(list))
    likes = defaultdict(dict)  # real trace -> kind -> rows of the compared policy
    with open(args.jsonl) as f:
        for line in f:
            row = json.loads(line)
            if row.get("question") != "replay":
                continue
            name = row["trace"]
            if name.startswith("synthetic:") and "~" in name:
                kind, real = name[len("synthetic:"):].split("~", 1)
                if row["policy"] == args.compare:
                    likes[real].setdefault(kind, []).append(row)
                continue
            by_trace[name][row["policy"]].append(row)
    if args.traces:
        by_trace = {n: s for n, s in by_trace.items() if any(t in n for t in args.traces)}
    if not by_trace:
        raise SystemExit(f"{args.jsonl} holds no replay rows (question == 'replay') to plot")
    if args.table:
        for name, series in sorted(by_trace.items()):
            print(markdown_table(name, series))
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 3 if any(n.split("/")[-1] in likes or n in likes for n in by_trace) else 2
    fig, axes = plt.subplots(len(by_trace), cols, figsize=(5.2 * cols, 3.4 * len(by_trace)),
                             squeeze=False)
    for (name, series), row_axes in zip(sorted(by_trace.items()), axes):
        left, right = row_axes[0], row_axes[1]
        for policy, rows in sorted(series.items()):
            rows.sort(key=lambda r: r["multiple"])
            budget = [r["multiple"] for r in rows]
            style = "k--" if policy == "belady" else "o-"
            left.plot(budget, [r["hit_rate"] for r in rows], style, label=policy, ms=3)
            right.plot(budget, [r["ratio_to_belady"] for r in rows], style, label=policy, ms=3)
        first = next(iter(series.values()))[0]
        short = name.split("/")[-1]
        title = f"{short} (k {first['topk']}, W {first['ways']}, from position {first['context']})"
        panels = [(left, "hit rate"), (right, "copies / Belady's")]
        if cols == 3:
            third = row_axes[2]
            similar = likes.get(short, likes.get(name, {}))
            if not similar:
                third.axis("off")
            else:
                for policy, style in ((args.compare, "o-"), ("belady", "--")):
                    mine = sorted(series.get(policy, []), key=lambda r: r["multiple"])
                    third.plot([r["multiple"] for r in mine], [r["hit_rate"] for r in mine],
                               style, color="black", lw=2, label=f"this trace, {policy}", ms=3)
                for kind, rows in sorted(similar.items()):
                    rows.sort(key=lambda r: r["multiple"])
                    third.plot([r["multiple"] for r in rows], [r["hit_rate"] for r in rows],
                               ".:", label=f"synthetic {kind}")
                third.axhline(0.97, color="grey", lw=0.8)
                panels.append((third, f"hit rate ({args.compare})"))
                third.legend(fontsize=6)
        for ax, label in panels:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("hot-cache slots C / k")
            ax.set_ylabel(label)
            ax.set_title(title, fontsize=8)
            ax.grid(alpha=0.3)
        left.axhline(0.97, color="grey", lw=0.8)
        right.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
