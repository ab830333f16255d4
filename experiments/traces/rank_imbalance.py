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

Rules: those of fo_jax.placement (round_robin is the baseline), least_misses_lookahead
(`fill`: among the first n + --lookahead waiting requests, seat those that even out the
ranks' expected misses; a request skipped --patience times goes first), and oracle_mean (a
bound, not a rule: least_misses knowing each request's true mean misses over its output).
Every rule sees the same arrivals and requests (per seed, mix and load); seating first come,
first served, all but the lookahead run the same requests at the same steps, so only the
spread differs. One JSON line per (mix, load, rule): mean misses per rank per step, the mean of
the per-step maximum, the spread (mean max / mean), p50 / p99 of max - mean, the excess H2D
megabytes per step at glm52's rows (78 layers x 1152 bytes per missed row), the spread had
every running request been free to move to any rank at every step (free moves: what no
placement of whole requests can beat by much), queueing and occupancy.

    python -m experiments.traces.rank_imbalance                  # 8 ranks x 4 seats, 3 seeds
    python -m experiments.traces.rank_imbalance --seats 16       # more requests per rank
    python -m experiments.traces.rank_imbalance --table results/rank_imbalance/rank_imbalance.jsonl
    python -m experiments.traces.rank_imbalance --smoke          # seconds; run by the tests
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import numpy as np

from experiments.common import run_metadata, write_jsonl  # noqa: E402

from fo_jax import placement, replay, synthetic_traces  # noqa: E402

GLM52_LAYERS, GLM52_ROW_BYTES = 78, 576 * 2
MIXES = ("contexts", "kinds", "both")
ORACLE = "oracle_mean"
FILL = "least_misses_lookahead"
DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "..", "results",
                           "traces", "rank_imbalance",
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


def simulate(rule, arrivals, library, *, ranks, seats, topk, hot_slots, weight=0.05,
             lookahead=8, patience=8):
    """Run one placement rule over `arrivals`: ([T, R] misses per rank and step, [T, R]
    requests running per rank and step, queueing delays in steps, [T] free moves: the step's
    maximum had every running request been free to move to any rank at that step (LPT on the
    step's own misses, seats kept): about the least a placement of whole requests can reach).

    `rule` is one of fo_jax.placement.RULES, or ORACLE: least_misses with each request's true
    mean misses over its output as its cost (what no scheduler knows: the best a rule that
    balances expected misses could do), or FILL: least_misses seating the requests that even
    out the loads among the first n + `lookahead` waiting (`fill`), a request
    skipped `patience` times seated first."""
    steps = len(arrivals)
    misses = np.zeros((steps, ranks), np.int64)
    running_count = np.zeros((steps, ranks), np.int64)
    free_moves = np.zeros(steps, np.int64)
    running = [[] for _ in range(ranks)]  # per rank: [request, position, estimate]
    queue = collections.deque()
    waits = []
    turn = 0
    observed = predicted = 0.0  # calibration of the context prior by what requests report
    for t in range(steps):
        queue.extend([t, req, 0] for req in arrivals[t])  # [arrival step, request, skips]
        free = [seats - len(running[r]) for r in range(ranks)]
        n = min(len(queue), sum(free))
        if n:
            window = [queue[i] for i in range(min(len(queue),
                                                   n + (lookahead if rule == FILL else 0)))]
            scale = observed / predicted if predicted else 1.0
            if rule == "least_context":
                costs = [req["context"] for _, req, _ in window]
                load = [sum(q["context"] + pos for q, pos, _ in running[r])
                        for r in range(ranks)]
            elif rule in ("least_misses", FILL):
                costs = [scale * placement.expected_misses(req["context"], hot_slots=hot_slots,
                                                           topk=topk) for _, req, _ in window]
                load = [sum(est for _, _, est in running[r]) for r in range(ranks)]
            elif rule == ORACLE:  # each request's true mean misses over its whole output
                costs = [lifetime_mean(library, req) for _, req, _ in window]
                load = [sum(lifetime_mean(library, q) for q, _, _ in running[r])
                        for r in range(ranks)]
            else:
                costs = [0.0] * len(window)
                load = [len(running[r]) for r in range(ranks)]
            if rule == FILL:
                forced = next((i for i, item in enumerate(window) if item[2] < patience),
                              len(window))
                placed = fill(costs, load=load, free=free, lookahead=lookahead,
                                        forced=forced)
            else:
                placed, turn = placement.assign("least_misses" if rule == ORACLE else rule,
                                                costs, load=load, free=free, turn=turn)
            for item, r, cost in zip(window, placed, costs):
                if r < 0:
                    item[2] += 1
                    continue
                running[r].append([item[1], 0, cost])
                waits.append(t - item[0])
            queue = collections.deque(
                [item for item, r in zip(window, placed) if r < 0] +
                [queue[i] for i in range(len(window), len(queue))])
        now = [int(library[req["kind"], req["context"]][req["series"], pos])
               for r in range(ranks) for req, pos, _ in running[r]]
        if now:  # every running request free to move at this step: LPT on its misses
            moved, _ = placement.assign("least_misses", now, load=[0] * ranks,
                                        free=[seats] * ranks)
            per_rank = np.zeros(ranks, np.int64)
            np.add.at(per_rank, moved, now)
            free_moves[t] = per_rank.max()
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
    return misses, running_count, waits, free_moves


def fill(costs, *, load, free, lookahead: int, forced: int = 0) -> list[int]:
    """Seat waiting requests when more wait than seats are free, choosing among the first ones.

    With every seat taken, a request can only go where a seat frees: placement.assign has no
    choice to make. `fill` looks `lookahead` requests past the n = min(m, sum(free)) it seats
    and picks the n that even out the loads: one seat at a time, the least loaded rank with a
    free seat takes the candidate whose cost brings it closest to its share of the mean load
    after the placement, T = (sum(load) + n mean(candidate costs)) / R, i.e. the cost nearest to
    (T - load[r]) / free[r]. Requests skipped wait for a later call: the caller bounds how long
    (`forced`). With no more requests than seats it is placement.assign("least_misses", ...).
    Not in fo_jax.placement: it did not pay here (see the README's "Rank imbalance").

    Args:
      costs: [m] the waiting requests' costs, in arrival order (as for placement.assign).
      load: [R] each rank's load; free: [R] free seats per rank (as for placement.assign).
      lookahead: requests past the first n that may be seated before them (>= 0; 0 is first
        come, first seated).
      forced: the first `forced` requests are seated before any choice (requests the caller
        has seen skipped too often), at most n of them.

    Returns:
      [m] the rank of each request, -1 for those left waiting. O(n (lookahead + n + R)).
    """
    m, n = len(costs), min(len(costs), sum(free))
    if m <= n:
        return placement.assign("least_misses", costs, load=load, free=free)[0]
    load, free = [float(x) for x in load], list(free)
    out = [-1] * m
    candidates = list(range(min(m, n + lookahead)))
    for seated in range(n):
        r = min((q for q in range(len(load)) if free[q]), key=lambda q: (load[q], -free[q], q))
        if seated < forced:
            i = candidates[0]
        else:
            mean_cost = sum(costs[j] for j in candidates) / len(candidates)
            target = (sum(load) + (n - seated) * mean_cost) / len(load)
            want = (target - load[r]) / free[r]
            i = min(candidates, key=lambda j: (abs(costs[j] - want), j))
        candidates.remove(i)
        out[i], free[r] = r, free[r] - 1
        load[r] += costs[i]
    return out


def lifetime_mean(library, req) -> float:
    """A request's true mean misses per step over its output (known to the oracle only)."""
    return float(library[req["kind"], req["context"]][req["series"], :req["length"]].mean())


def summarize(misses, running_count, waits, free_moves, *, warmup):
    """The row of one (mix, load, rule): statistics over steps >= warmup (all seeds)."""
    m = misses[warmup:]
    mean, peak = m.mean(1), m.max(1)
    free_moves = free_moves[warmup:]
    excess = peak - mean
    return {
        "misses_per_rank_step": float(mean.mean()),
        "max_rank_misses_per_step": float(peak.mean()),
        "spread": float(peak.mean() / max(mean.mean(), 1e-12)),
        "excess_p50": float(np.percentile(excess, 50)),
        "excess_p99": float(np.percentile(excess, 99)),
        "excess_mean": float(excess.mean()),
        "free_moves_spread": float(free_moves.mean() / max(mean.mean(), 1e-12)),
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
             "p99 (max - mean) | excess vs round robin | max / mean, free moves | "
             "wait (steps) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    base = {(r["mix"], r["load"]): r for r in rows if r["rule"] == "round_robin"}
    for r in rows:
        b = base.get((r["mix"], r["load"]))
        versus = f"{r['excess_mean'] / b['excess_mean']:.2f}x" if b and b["excess_mean"] \
            else "-"
        lines.append(f"| {r['mix']} | {r['load']:.2f} | {r['rule']} | "
                     f"{r['misses_per_rank_step']:.1f} | {r['max_rank_misses_per_step']:.1f} | "
                     f"{r['spread']:.3f} | {r['excess_p99']:.1f} | {versus} | "
                     f"{r['free_moves_spread']:.3f} | {r['wait_mean_steps']:.1f} |")
    return "\n".join(lines)


def pivot(rows) -> str:
    """A markdown table with one line per (mix, load): max / mean per rule, the free-moves
    spread, and p99 of max - mean under round robin and least_misses."""
    rules = [r for r in ("round_robin", "least_requests", "least_context", "least_misses", FILL,
                         ORACLE) if any(x["rule"] == r for x in rows)]
    cells = {(r["mix"], r["load"], r["rule"]): r for r in rows}
    lines = ["| mix | load | misses / rank / step | max / mean: " + " | ".join(rules) +
             " | free moves | p99 (max - mean): round robin, least_misses |",
             "|---|---|---|" + "---|" * (len(rules) + 2)]
    for mix, load in dict.fromkeys((r["mix"], r["load"]) for r in rows):
        got = [cells.get((mix, load, rule)) for rule in rules]
        first = next(g for g in got if g)
        p99 = ", ".join(f"{cells[mix, load, q]['excess_p99']:.0f}"
                        if (mix, load, q) in cells else "-"
                        for q in ("round_robin", "least_misses"))
        lines.append(f"| {mix} | {load:.2f} | {first['misses_per_rank_step']:.1f} | " +
                     " | ".join(f"{g['spread']:.2f}" if g else "-" for g in got) +
                     f" | {first['free_moves_spread']:.2f} | {p99} |")
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
    parser.add_argument("--rules", nargs="+", default=list(placement.RULES) + [FILL, ORACLE],
                        help=f"rules of fo_jax.placement, {FILL} (`fill`) and {ORACLE} "
                             "(a bound); see simulate")
    parser.add_argument("--lookahead", type=int, default=8,
                        help=f"{FILL}: waiting requests looked past")
    parser.add_argument("--patience", type=int, default=8,
                        help=f"{FILL}: skips before a request is seated first")
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
    parser.add_argument("--weight", type=float, default=0.05,
                        help="least_misses: the EMA weight of a request's newest step")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--table", default=None,
                        help="print the tables of these JSON lines (a finished run) and stop")
    parser.add_argument("--out", default=None,
                        help="append JSON lines here (default: results/rank_imbalance/"
                             "rank_imbalance.jsonl; none with --smoke)")
    args = parser.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        print(table(rows) + "\n\n" + pivot(rows))
        return rows
    if args.out is None and not args.smoke:
        args.out = DEFAULT_OUT
    if args.smoke:
        args.ranks, args.seats, args.steps, args.warmup, args.seeds = 4, 2, 120, 20, [0]
        args.loads, args.kinds, args.contexts = [0.8], ["topics", "uniform"], [256, 1024]
        args.kinds_context, args.output_len, args.topk, args.hot_slots = 1024, [8, 24], 16, 256
        args.page_size, args.per_cell = 16, 2
    unknown = set(args.rules) - set(placement.RULES) - {FILL, ORACLE}
    if unknown:
        parser.error(f"unknown rules {sorted(unknown)}; choose among "
                     f"{placement.RULES + (FILL, ORACLE)}")
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
                                               hot_slots=args.hot_slots, weight=args.weight,
                                               lookahead=args.lookahead,
                                               patience=args.patience))
            for rule in args.rules:
                got = runs[rule]
                row = summarize(np.concatenate([m[args.warmup:] for m, _, _, _ in got]),
                                np.concatenate([c[args.warmup:] for _, c, _, _ in got]),
                                [w for _, _, ws, _ in got for w in ws],
                                np.concatenate([f[args.warmup:] for _, _, _, f in got]),
                                warmup=0)
                rows.append({**meta, "question": "rank_imbalance", "mix": mix, "load": load,
                             "rule": rule, "ranks": args.ranks, "seats": args.seats,
                             "steps": args.steps, "warmup": args.warmup,
                             "seeds": args.seeds, "kinds": args.kinds,
                             "contexts": args.contexts, "kinds_context": args.kinds_context,
                             "output_len": args.output_len, "topk": args.topk,
                             "hot_slots": args.hot_slots, "page_size": args.page_size,
                             "weight": args.weight, "lookahead": args.lookahead,
                             "patience": args.patience, **row})
    write_jsonl(args.out, rows)
    print(table(rows) + "\n\n" + pivot(rows))
    return rows


if __name__ == "__main__":
    main()
