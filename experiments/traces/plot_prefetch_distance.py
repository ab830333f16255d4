"""Plot experiments/traces/prefetch_distance.py's JSON lines: modelled exposure and measured cost.

    python -m experiments.traces.plot_prefetch_distance [--jsonl results/prefetch_distance.jsonl]
        [--out results/prefetch_distance.png] [--preset glm52] [--chunk 4096]

Panels: exposed load time of a whole prefill against context, one line per (distance, buffers),
for each hardware profile (the pipeline model); and the measured wall time of the offloaded
prefill as a ratio to the resident prefill of the same run (the latest run in the file). When a
key appears more than once (the file is appended to), the last line wins.
"""

from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "results")


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot(rows: list[dict], out: str, *, preset: str, chunk: int) -> str:
    model = {}
    for r in rows:
        if r["kind"] == "model" and r["preset"] == preset and r["chunk"] == chunk:
            model[(r["profile"], r["distance"], r["num_buffers"], r["context"])] = r
    measured = [r for r in rows if r["kind"] == "measured"]
    if measured:  # the latest measured run: the lines after the last resident baseline
        last = max(i for i, r in enumerate(measured) if r["path"] == "resident")
        measured = measured[last:]
    profiles = sorted({k[0] for k in model})
    panels = len(profiles) + (1 if measured else 0)
    if panels == 0:
        raise SystemExit(f"no rows for preset {preset!r}, chunk {chunk} and no measurements")
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2), squeeze=False)
    axes = axes[0]
    for ax, profile in zip(axes, profiles):
        pairs = sorted({(d, n) for p, d, n, _ in model if p == profile}, key=lambda x: (x[1], x[0]))
        for d, n in pairs:
            points = sorted((c, r) for (p, dd, nn, c), r in model.items()
                            if (p, dd, nn) == (profile, d, n))
            contexts = [c / 1024 for c, _ in points]
            # Pairs often coincide (the same d hides the same): marker by d, line style by n.
            ax.plot(contexts, [r["exposed_load_s"] for _, r in points],
                    marker={1: "o", 2: "s", 3: "^"}.get(d, "x"), markersize=4 + 2 * (3 - d),
                    linestyle={3: "-", 4: "--", 6: ":"}.get(n, "-."), label=f"d={d}, n={n}")
        compute = sorted((c, r["no_offload_s"]) for (p, _, _, c), r in model.items()
                         if p == profile)
        ax.plot([c / 1024 for c, _ in compute], [v * 0.01 for _, v in compute], color="gray",
                lw=0.8, label="1% of compute")
        ax.set_xscale("log", base=2)
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("context (k tokens)")
        ax.set_ylabel("exposed load time per prefill (s)")
        ax.set_title(f"{preset}, chunk {chunk}, {profile} (model)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    if measured:
        ax = axes[-1]
        offload = [r for r in measured if r["path"] == "offload"]
        labels = [f"d={r['distance']}\nn={r['num_buffers']}" for r in offload]
        ax.bar(range(len(offload)), [r["ratio_to_resident"] for r in offload])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(offload)), labels, fontsize=8)
        ax.set_ylabel("offloaded / resident wall time")
        base = measured[0]
        ax.set_title(f"measured on {base['backend']}: {base['preset']} {base['num_layers']}L, "
                     f"{base['capacity']} tok / {base['chunk']}", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jsonl", default=os.path.join(RESULTS, "prefetch_distance.jsonl"))
    parser.add_argument("--out", default=os.path.join(RESULTS, "prefetch_distance.png"))
    parser.add_argument("--preset", default="glm52")
    parser.add_argument("--chunk", type=int, default=4096)
    args = parser.parse_args(argv)
    out = plot(load(args.jsonl), args.out, preset=args.preset, chunk=args.chunk)
    print(f"wrote {os.path.normpath(out)}")
    return out


if __name__ == "__main__":
    main()
