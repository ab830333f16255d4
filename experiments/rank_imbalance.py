"""Rank imbalance of data-parallel decode: per-rank misses per step, by placement rule.

With R data-parallel ranks each decode step waits for the rank with the most misses (each rank
copies its own requests' misses from its own host pool). This simulates R ranks of `--seats`
seats each, requests arriving as a Poisson process and queueing first come first served, each
placed on a rank by a rule of fo_jax.placement when a seat is free and staying there until it
has decoded its output. A request's misses per step come from a replay (fo_jax.replay, ring, C
= `--hot-slots`, one indexer group) of a synthetic trace (fo_jax.synthetic_traces) of its
workload kind and context length: a library of (kind, context) traces is replayed once, and
each request takes one of its series. Per step a rank's misses are the sum over its running
requests; the step's cost is the maximum over ranks, the mean is what a balanced step would
copy. Workload mixes:

    contexts   topic shifts (the synthetic workload the trained model resembles, see the
               README's trace replay), context lengths drawn from --contexts
    kinds      one context (--kinds-context), the locality drawn from --kinds: the context
               says nothing about the misses
    both       both drawn

Every rule sees the same arrivals and requests (per seed, mix and load). One JSON line per
(mix, load, rule): mean misses per rank per step, the mean of the per-step maximum, the spread
(mean max / mean), p50 / p99 of max - mean, the excess H2D megabytes per step at glm52's rows
(78 layers x 1152 bytes per missed row), queueing and occupancy.

    python experiments/rank_imbalance.py                  # 8 ranks x 4 seats, 3 seeds
    python experiments/rank_imbalance.py --smoke          # seconds; run by the tests
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import run_metadata, write_jsonl  # noqa: E402

from fo_jax import placement, replay, synthetic_traces  # noqa: E402

GLM52_LAYERS, GLM52_ROW_BYTES = 78, 576 * 2
MIXES = ("contexts", "kinds", "both")
DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "results", "rank_imbalance",
                           "rank_imbalance.jsonl")


def miss_library(kinds, contexts, *, steps, topk, hot_slots, page_size, per_cell, seed):
    """{(kind, context): [per_cell, steps] int misses per step} (the ring replay's union of one
    group), from one synthetic trace of `per_cell` requests per (kind, context)."""
    library = {}
    for i, kind in enumerate(kinds):
        for j, context in enumerate(contexts):
            trace = synthetic_traces.generate(
                kind, steps=steps, context=context, topk=topk, groups=1, batch=per_cell,
                page_size=page_size, seed=seed + 1000 * i + j)
            stats = replay.replay(trace, hot_slots=hot_slots, policy="ring")
            library[kind, context] = stats.union[:, 0, :].T.astype(np.int64)  # [B, T]
    return library


def workload(mix, *, rate, steps, kinds, contexts, kinds_context, output_len, per_cell, seed):
    """The arrivals of one run: a list over steps of the requests arriving then, each a dict
    (kind, context, series index, output length)."""
    rng = np.random.default_rng(seed)
    arrivals = []
    for _ in range(steps):
        now = []
        for _ in range(rng.poisson(rate)):
            kind = "topics" if mix == "contexts" else kinds[rng.integers(len(kinds))]
            context = kinds_context if mix == "kinds" else contexts[rng.integers(len(contexts))]
            now.append({"kind": kind, "context": int(context),
                        "series": int(rng.integers(per_cell)),
                        "length": int(rng.integers(output_len[0], output_len[1] + 1))})
        arrivals.append(now)
    return arrivals


def simulate(rule, arrivals, library, *, ranks, seats, topk, hot_slots, weight=0.25):
    """Run one placement rule over `arrivals`: ([T, R] misses per rank and step, [T, R]
    requests running per rank and step, queueing delays in steps)."""
    steps = len(arrivals)
    misses = np.zeros((steps, ranks), np.int64)
    running_count = np.zeros((steps, ranks), np.int64)
    running = [[] for _ in range(ranks)]  # per rank: [request, position, estimate]
    queue = collections.deque()
    waits = []
    turn = 0
    observed = predicted = 0.0  # calibration of the context prior by what requests report
    for t in range(steps):
        queue.extend((t, req) for req in arrivals[t])
        free = [seats - len(running[r]) for r in range(ranks)]
        n = min(len(queue), sum(free))
        if n:
            new = [queue.popleft() for _ in range(n)]
            scale = observed / predicted if predicted else 1.0
            priors = [placement.expected_misses(req["context"], hot_slots=hot_slots,
                                                topk=topk) for _, req in new]
            if rule == "least_context":
                costs = [req["context"] for _, req in new]
                load = [sum(q["context"] + pos for q, pos, _ in running[r])
                        for r in range(ranks)]
            elif rule == "least_misses":
                costs = [p * scale for p in priors]
                load = [sum(est for _, _, est in running[r]) for r in range(ranks)]
            else:
                costs = [0.0] * n
                load = [len(running[r]) for r in range(ranks)]
            placed, turn = placement.assign(rule, costs, load=load, free=free, turn=turn)
            for (arrived, req), r, cost in zip(new, placed, costs):
                running[r].append([req, 0, cost])
                waits.append(t - arrived)
        for r in range(ranks):
            keep = []
            for item in running[r]:
                req, pos, est = item
                got = int(library[req["kind"], req["context"]][req["series"], pos])
                misses[t, r] += got
                observed += got
                predicted += placement.expected_misses(req["context"] + pos,
                                                       hot_slots=hot_slots, topk=topk)
                item[1], item[2] = pos + 1, placement.update_estimate(est, got, weight=weight)
                if item[1] < req["length"]:
                    keep.append(item)
            running_count[t, r] = len(running[r])
            running[r] = keep
    return misses, running_count, waits


def summarize(misses, running_count, waits, *, warmup):
    """The row of one (mix, load, rule): statistics over steps >= warmup (all seeds)."""
    m = misses[warmup:]
    mean, peak = m.mean(1), m.max(1)
    excess = peak - mean
    return {
        "misses_per_rank_step": float(mean.mean()),
        "max_rank_misses_per_step": float(peak.mean()),
        "spread": float(peak.mean() / max(mean.mean(), 1e-12)),
        "excess_p50": float(np.percentile(excess, 50)),
        "excess_p99": float(np.percentile(excess, 99)),
        "excess_mean": float(excess.mean()),
        "excess_h2d_mb_per_step": float(excess.mean()) * GLM52_LAYERS * GLM52_ROW_BYTES / 1e6,
        "running_per_rank": float(running_count[warmup:].mean()),
        "running_spread": float(running_count[warmup:].max(1).mean()
                                / max(running_count[warmup:].mean(), 1e-12)),
        "wait_mean_steps": float(np.mean(waits)) if waits else 0.0,
        "steps_measured": int(m.shape[0]),
    }


def table(rows) -> str:
    """A markdown table of the rows: per (mix, load) each rule against round_robin."""
    lines = ["| mix | load | rule | misses / rank / step | max rank | max / mean | "
             "p99 (max - mean) | excess vs round robin |",
             "|---|---|---|---|---|---|---|---|"]
    base = {(r["mix"], r["load"]): r for r in rows if r["rule"] == "round_robin"}
    for r in rows:
        b = base.get((r["mix"], r["load"]))
        versus = f"{r['excess_mean'] / b['excess_mean']:.2f}x" if b and b["excess_mean"] \
            else "-"
        lines.append(f"| {r['mix']} | {r['load']:.2f} | {r['rule']} | "
                     f"{r['misses_per_rank_step']:.1f} | {r['max_rank_misses_per_step']:.1f} | "
                     f"{r['spread']:.3f} | {r['excess_p99']:.1f} | {versus} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--seats", type=int, default=4, help="requests per rank at most")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=300, help="steps left out of the stats")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--loads", type=float, nargs="+", default=[0.7, 0.9, 1.2],
                        help="offered load: arrival rate x mean output length / (R seats)")
    parser.add_argument("--mixes", nargs="+", default=list(MIXES))
    parser.add_argument("--rules", nargs="+", default=list(placement.RULES))
    parser.add_argument("--kinds", nargs="+", default=["topics", "vertical", "recency",
                                                       "uniform"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 8192, 32768])
    parser.add_argument("--kinds-context", type=int, default=8192)
    parser.add_argument("--output-len", type=int, nargs=2, default=[32, 256])
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--hot-slots", type=int, default=1024)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--per-cell", type=int, default=4,
                        help="replayed requests per (kind, context) of the library")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=DEFAULT_OUT, help="append JSON lines here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.ranks, args.seats, args.steps, args.warmup, args.seeds = 4, 2, 120, 20, [0]
        args.loads, args.kinds, args.contexts = [0.8], ["topics", "uniform"], [256, 1024]
        args.kinds_context, args.output_len, args.topk, args.hot_slots = 1024, [8, 24], 16, 256
        args.page_size, args.per_cell = 16, 2
    unknown = set(args.rules) - set(placement.RULES)
    if unknown:
        parser.error(f"unknown rules {sorted(unknown)}; choose among {placement.RULES}")
    if set(args.mixes) - set(MIXES):
        parser.error(f"unknown mixes {sorted(set(args.mixes) - set(MIXES))}; choose among "
                     f"{MIXES}")
    kinds = sorted(set(args.kinds) | ({"topics"} if "contexts" in args.mixes else set()))
    contexts = sorted(set(args.contexts) | {args.kinds_context})
    start = time.perf_counter()
    library = miss_library(kinds, contexts, steps=args.output_len[1], topk=args.topk,
                           hot_slots=args.hot_slots, page_size=args.page_size,
                           per_cell=args.per_cell, seed=1)
    print(f"library: {len(library)} (kind, context) cells replayed in "
          f"{time.perf_counter() - start:.1f} s")
    mean_len = (args.output_len[0] + args.output_len[1]) / 2
    meta = run_metadata()
    rows = []
    for mix in args.mixes:
        for load in args.loads:
            rate = load * args.ranks * args.seats / mean_len
            runs = {rule: [] for rule in args.rules}
            for seed in args.seeds:
                arrivals = workload(mix, rate=rate, steps=args.steps, kinds=args.kinds,
                                    contexts=args.contexts, kinds_context=args.kinds_context,
                                    output_len=args.output_len, per_cell=args.per_cell,
                                    seed=seed)
                for rule in args.rules:
                    runs[rule].append(simulate(rule, arrivals, library, ranks=args.ranks,
                                               seats=args.seats, topk=args.topk,
                                               hot_slots=args.hot_slots))
            for rule in args.rules:
                got = runs[rule]
                row = summarize(np.concatenate([m[args.warmup:] for m, _, _ in got]),
                                np.concatenate([c[args.warmup:] for _, c, _ in got]),
                                [w for _, _, ws in got for w in ws], warmup=0)
                rows.append({**meta, "question": "rank_imbalance", "mix": mix, "load": load,
                             "rule": rule, "ranks": args.ranks, "seats": args.seats,
                             "steps": args.steps, "warmup": args.warmup,
                             "seeds": args.seeds, "kinds": args.kinds,
                             "contexts": args.contexts, "kinds_context": args.kinds_context,
                             "output_len": args.output_len, "topk": args.topk,
                             "hot_slots": args.hot_slots, "page_size": args.page_size,
                             **row})
    write_jsonl(args.out, rows)
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
