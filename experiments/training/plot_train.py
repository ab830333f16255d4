"""Loss curves of a training run: bits per byte and indexer KL per step, held-out evaluations.

    python -m experiments.training.plot_train --jsonl runs/trained-small/log.jsonl \\
        --out runs/trained-small/loss.png
"""

from __future__ import annotations

import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jsonl", required=True)
    p.add_argument("--out", default=None, help="PNG path (default: next to the log, loss.png)")
    args = p.parse_args(argv)
    rows = [json.loads(line) for line in pathlib.Path(args.jsonl).read_text().splitlines()
            if line.strip()]
    steps = [r for r in rows if r["kind"] == "step"]
    evals = [r for r in rows if r["kind"] == "eval"]
    fig, (ax, kl) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for stage, colour in (("dense", "tab:blue"), ("sparse", "tab:orange")):
        mine = [r for r in steps if r["stage"] == stage]
        if mine:
            ax.plot([r["step"] for r in mine], [r["bits_per_byte"] for r in mine], colour,
                    label=f"train ({stage} stage)")
            kl.plot([r["step"] for r in mine], [r["indexer_kl"] for r in mine], colour,
                    label=f"indexer KL ({stage}: {'causal keys' if stage == 'dense' else 'top-k set'})")
    for r in evals:
        ax.scatter([r["step"]], [r["bits_per_byte"]], marker="x", color="k", zorder=3)
    if evals:
        text = "\n".join(f"{r['name']} (window {r.get('window', '?')}): "
                         f"{r['bits_per_byte']:.3f}" for r in evals)
        ax.text(0.02, 0.03, "held-out bits/byte\n" + text, transform=ax.transAxes, fontsize=7,
                va="bottom", family="monospace",
                bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "0.7"})
    ax.set_ylabel("bits per byte")
    ax.set_title("DSA training on the Python stdlib (x: held-out evaluations)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    kl.set_ylabel("indexer KL (nats)")
    kl.set_xlabel("step")
    kl.legend(fontsize=8)
    kl.grid(alpha=0.3)
    out = args.out or str(pathlib.Path(args.jsonl).with_name("loss.png"))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(main())
