"""Plot serving_latency.py output: TTFT and inter-token latency (p50 and p99) per run."""

from __future__ import annotations

import argparse
import json


def _label(row) -> str:
    path = "offloaded" if row.get("offload") else "resident"
    return (f"{path}, {row['clients']} clients, {row['seats']} seats, "
            f"N={row.get('decode_steps_per_call', 1)}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("jsonl", nargs="?", default="results/serving_latency.jsonl")
    parser.add_argument("--out", default="results/serving_latency.png")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.jsonl) as f:
        rows = [r for r in map(json.loads, f) if r.get("experiment") == "serving_latency"]
    if not rows:
        raise SystemExit(f"{args.jsonl} holds no serving_latency rows")
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.6 * len(rows) + 2.2))
    ys = range(len(rows))
    for ax, (name, key, scale, unit) in zip(axes, (
            ("time to first token", "ttft", 1.0, "s"),
            ("inter-token latency", "itl", 1e3, "ms"))):
        p50 = [r[f"{key}_p50"] * scale for r in rows]
        p99 = [r[f"{key}_p99"] * scale for r in rows]
        ax.barh([y + 0.2 for y in ys], p99, height=0.4, label="p99", color="tab:orange")
        ax.barh([y - 0.2 for y in ys], p50, height=0.4, label="p50", color="tab:blue")
        ax.set_yticks(list(ys))
        ax.set_yticklabels([_label(r) for r in rows] if ax is axes[0] else [])
        ax.set_xlabel(f"{name} ({unit})")
        ax.grid(axis="x", alpha=0.3)
        ax.legend()
    fig.suptitle(f"streaming clients over HTTP ({rows[-1].get('backend', '?')})")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
