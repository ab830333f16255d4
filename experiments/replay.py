"""Eviction policies against Belady's MIN on top-k traces: replay policies x cache budgets.

Replays each trace (a recorded `.npz` in the fo_jax.traces format, or a synthetic workload of
fo_jax.synthetic_traces) under every policy of fo_jax.replay and hot-cache budgets of
C = m * k slots (skipping C < k W, which fo_jax refuses), and writes one JSON line per
(trace, policy, C): misses per request per group per step (the W-way union), per-way misses,
hit rate, H2D bytes per generated token at glm52's rows (576 bf16 values = 1152 bytes per
layer, 78 layers: every layer of a group copies the group's union), the ratio of the policy's
copies to Belady's, the mean union per step (a series, for plots), and ECHO's prefetch
counts where the trace has every token's scores.

    python experiments/replay.py --trace traces/doc0.npz [--trace ...]
    python experiments/replay.py --synthetic recency sinks vertical topics --context 8192
    python experiments/replay.py --smoke                  # seconds; run by the tests
    python experiments/plot_replay.py results/replay.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import run_metadata, write_jsonl  # noqa: E402

from fo_jax import replay, synthetic_traces, traces  # noqa: E402

GLM52_LAYERS, GLM52_ROW_BYTES = 78, 576 * 2


def replay_rows(name: str, trace, *, multiples, policies, prefetch: bool) -> list[dict]:
    """The JSON rows of one trace: every policy at every budget m * k, Belady first."""
    k, ways = trace.topk, trace.ways
    info = {"trace": name, "meta": json.loads(trace.meta), "topk": k, "ways": ways,
            "groups": trace.groups, "batch": trace.batch, "steps": trace.steps,
            "context": int(trace.lengths[0].max()), "page_size": trace.page_size}
    rows = []
    order = ["belady"] + [p for p in policies if p != "belady"]
    for m in multiples:
        hot = m * k
        if hot < k * ways:
            print(f"  {name}: C = {m} k < k W = {k * ways}: skipped (fo_jax needs C >= k W)")
            continue
        bound = None
        for policy in order:
            if policy in replay.SCORE_POLICIES and trace.scores is None and \
                    trace.all_scores is None:
                continue
            start = time.perf_counter()
            stats = replay.replay(trace, hot_slots=hot, policy=policy,
                                  prefetch=prefetch and trace.all_scores is not None)
            seconds = time.perf_counter() - start
            row = replay.summary(stats, ways=ways, layers=GLM52_LAYERS,
                                 row_bytes=GLM52_ROW_BYTES)
            if policy == "belady":
                bound = max(row["total_union"], 1)
            rows.append({**info, "question": "replay", "policy": policy, "hot_slots": hot,
                         "multiple": m, **row,
                         "ratio_to_belady": row["total_union"] / bound,
                         "union_per_step": np.round(stats.union.mean((1, 2)), 3).tolist(),
                         "replay_seconds": seconds})
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", action="append", default=[], help="a recorded .npz trace")
    parser.add_argument("--synthetic", nargs="*", default=None,
                        help=f"synthetic workloads among {synthetic_traces.KINDS}")
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--ways", type=int, default=1)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--multiples", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--policies", nargs="+", default=list(replay.POLICIES))
    parser.add_argument("--prefetch", action="store_true",
                        help="count ECHO's prefetch (synthetic traces keep every score)")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.synthetic = ["recency", "topics"]
        args.steps, args.context, args.topk, args.ways, args.page_size = 24, 256, 16, 2, 16
        args.multiples, args.prefetch = [1, 2, 4], True
    unknown = set(args.policies) - set(replay.POLICIES)
    if unknown:
        parser.error(f"unknown policies {sorted(unknown)}; choose among {replay.POLICIES}")
    named = [(path, traces.load(path)) for path in args.trace]
    for kind in args.synthetic or ([] if args.trace else ["recency"]):
        named.append((f"synthetic:{kind}", synthetic_traces.generate(
            kind, steps=args.steps, context=args.context, topk=args.topk, groups=args.groups,
            batch=args.batch, ways=args.ways, page_size=args.page_size,
            keep_all_scores=args.prefetch)))
    meta = run_metadata()
    rows = []
    for name, trace in named:
        cells = replay_rows(name, trace, multiples=args.multiples, policies=args.policies,
                            prefetch=args.prefetch)
        print(f"{name}: T {trace.steps}, G {trace.groups}, B {trace.batch}, W {trace.ways}, "
              f"k {trace.topk}; misses / request / group / step (hit rate, x Belady)")
        budgets = sorted({c["hot_slots"] for c in cells})
        print(f"{'policy':11s}" + "".join(f"{f'C={c}':>24s}" for c in budgets))
        for policy in dict.fromkeys(c["policy"] for c in cells):
            mine = {c["hot_slots"]: c for c in cells if c["policy"] == policy}
            print(f"{policy:11s}" + "".join(
                f"{mine[c]['misses_per_request_group_step']:9.2f} "
                f"({mine[c]['hit_rate']:.3f}, {mine[c]['ratio_to_belady']:4.2f})"
                for c in budgets))
        rows += [{**meta, **c} for c in cells]
    write_jsonl(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
