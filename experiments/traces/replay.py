"""Eviction policies against Belady's MIN on top-k traces: replay policies x cache budgets.

Replays each trace (a recorded `.npz` in the fo_jax.traces format, or a synthetic workload of
fo_jax.synthetic_traces) under every policy of fo_jax.replay and hot-cache budgets of
C = m * k slots (skipping C < k W, which fo_jax refuses), and writes one JSON line per
(trace, policy, C): misses per request per group per step (the W-way union), per-way misses,
hit rate, H2D bytes per generated token at glm52's rows (576 bf16 values = 1152 bytes per
layer, 78 layers: every layer of a group copies the group's union), the ratio of the policy's
copies to Belady's, the mean union per step (a series, for plots), and ECHO's prefetch
counts where the trace has every token's scores.

    python -m experiments.traces.replay --trace traces/doc0.npz [--trace ...]
    python -m experiments.traces.replay --synthetic recency sinks vertical topics --context 8192
    python -m experiments.traces.replay --trace traces/ctx2048_w1.npz --like recency sinks topics
    python -m experiments.traces.replay --smoke                  # seconds; run by the tests

--like generates each named synthetic workload with a recorded trace's own shape (steps,
context, k, G, B, W, Z) and says which one resembles it: the mean absolute difference of their
hit rates over every (policy, C) cell both have ("question": "resemblance" rows), replaying
the synthetic ones under --like-policies only (default ring, lru, belady).
    python -m experiments.traces.plot_replay results/replay.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from experiments.common import run_metadata, write_jsonl  # noqa: E402

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


def resemblance(real: list[dict], synthetic: list[dict]) -> float:
    """Mean |hit rate difference| over the (policy, C) cells both row sets have."""
    mine = {(r["policy"], r["multiple"]): r["hit_rate"] for r in real}
    diffs = [abs(mine[key] - r["hit_rate"]) for r in synthetic
             if (key := (r["policy"], r["multiple"])) in mine]
    return float(np.mean(diffs)) if diffs else float("nan")


def like(trace, kind: str, *, keep_all_scores: bool):
    """A synthetic workload of `kind` with the shape of `trace` (steps, context, k, G, B, W, Z)."""
    return synthetic_traces.generate(
        kind, steps=trace.steps, context=int(trace.lengths[0].min()), topk=trace.topk,
        groups=trace.groups, batch=trace.batch, ways=trace.ways, page_size=trace.page_size,
        keep_all_scores=keep_all_scores)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", action="append", default=[], help="a recorded .npz trace")
    parser.add_argument("--synthetic", nargs="*", default=None,
                        help=f"synthetic workloads among {synthetic_traces.KINDS}")
    parser.add_argument("--like", nargs="*", default=None,
                        help="synthetic workloads generated with each --trace's shape, compared "
                             "with it (default: all of them; --like alone: none)")
    parser.add_argument("--like-ways", type=int, nargs="*", default=None,
                        help="generate --like workloads only for traces of these W (default all)")
    parser.add_argument("--like-policies", nargs="+", default=["ring", "lru", "belady"],
                        help="the policies replayed on --like workloads (and compared)")
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
    parser.add_argument("--no-series", action="store_true",
                        help="leave out union_per_step (smaller JSON lines)")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.synthetic = ["recency", "topics"]
        args.steps, args.context, args.topk, args.ways, args.page_size = 24, 256, 16, 2, 16
        args.multiples, args.prefetch = [1, 2, 4], True
        if args.trace:
            args.like = ["recency", "topics"]
    unknown = set(args.policies + args.like_policies) - set(replay.POLICIES)
    if unknown:
        parser.error(f"unknown policies {sorted(unknown)}; choose among {replay.POLICIES}")
    named = [(path, traces.load(path)) for path in args.trace]
    kinds_like = list(synthetic_traces.KINDS) if args.like is None else args.like
    unknown = set(kinds_like) - set(synthetic_traces.KINDS)
    if unknown:
        parser.error(f"unknown synthetic workloads {sorted(unknown)}; choose among "
                     f"{synthetic_traces.KINDS}")
    similar = []  # (real name, synthetic name)
    if args.trace:
        for path, trace in list(named):
            if args.like_ways is not None and trace.ways not in args.like_ways:
                continue
            for kind in kinds_like:
                named.append((f"synthetic:{kind}~{os.path.basename(path)}", like(
                    trace, kind, keep_all_scores=args.prefetch and trace.all_scores is not None)))
                similar.append((path, named[-1][0]))
    for kind in args.synthetic or ([] if args.trace else ["recency"]):
        named.append((f"synthetic:{kind}", synthetic_traces.generate(
            kind, steps=args.steps, context=args.context, topk=args.topk, groups=args.groups,
            batch=args.batch, ways=args.ways, page_size=args.page_size,
            keep_all_scores=args.prefetch)))
    meta = run_metadata()
    rows = []
    for name, trace in named:
        liked = any(name == synthetic for _, synthetic in similar)
        cells = replay_rows(name, trace, multiples=args.multiples,
                            policies=args.like_policies if liked else args.policies,
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
        if args.no_series:
            for c in cells:
                del c["union_per_step"]
        rows += [{**meta, **c} for c in cells]
    for real, synthetic in similar:
        replayed = [r for r in rows if r["question"] == "replay"]
        distance = resemblance([r for r in replayed if r["trace"] == real],
                               [r for r in replayed if r["trace"] == synthetic])
        rows.append({**meta, "question": "resemblance", "trace": real,
                     "synthetic": synthetic.split(":")[1].split("~")[0],
                     "mean_abs_hit_rate_difference": distance})
    for real in dict.fromkeys(r for r, _ in similar):
        ranked = sorted((r for r in rows if r.get("question") == "resemblance" and
                         r["trace"] == real), key=lambda r: r["mean_abs_hit_rate_difference"])
        print(f"{real} resembles (mean |hit rate difference|): " + ", ".join(
            f"{r['synthetic']} {r['mean_abs_hit_rate_difference']:.3f}" for r in ranked))
    write_jsonl(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
