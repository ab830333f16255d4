"""Decode-offload benchmark: management cost vs hot-cache size, and the whole step vs resident.

Two questions, one run (ratios are to baselines measured in the same run; these machines are
noisy, absolute times are not stable):

  management  per-step time of one group's management (`manage_group`: lookup, union, victims,
              map updates) at C = 2k ... 32k with fixed k, W and context, for the default
              ring policy, CLOCK and LRU (`--policies`). Every cell copies the same misses per step
              (hits come from the previous step's selection, misses are never-seen tokens), the
              cells are timed in interleaved rounds (A B C ..., then ... C B A), and the figures
              are the median and spread over rounds, with the ratio to the smallest C taken
              within each round. The ring policy touches O(K W + misses) entries and must
              stay flat; CLOCK's sweep is amortised O(K W + misses) but its trip count
              depends on the data; LRU takes a top-k over C and grows.
  step        the whole offloaded decode step against the resident decode step on the `small`
              preset (batch 4-8, long context, C = a quarter of the context), same tokens,
              same state contents (synthetic: random KV rows and indexer keys, so no
              multi-hour CPU prefill is needed; both paths compute exactly the same logits),
              for two workloads: `locality` (a favoured tenth of the tokens: a working set
              smaller than the hot cache) and `uniform` (low locality: hit rate about C / S).
              Median and spread of per-step times, the paired ratio, and the hit rate, for
              each policy of `--policy` (ring and CLOCK side by side: `--policy ring clock`),
              at each batch of `--batch` in turn, rows moved as `--host-access` says (default:
              the backend's, `fo_jax.offload.config.default_host_access`). Each batch's rows
              are appended to `--out` as it ends.

    python -m experiments.decode.decode_bench                       # both, CPU sizes
    python -m experiments.decode.decode_bench --what step --batch 8 32 1 --host-access ffi  # a GPU
    python -m experiments.decode.decode_bench --smoke               # seconds; run by the tests
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import (  # noqa: E402
    median_time, run_metadata, synthetic_states, write_jsonl)

from fo_jax import resident  # noqa: E402
from fo_jax.config import get_config  # noqa: E402
from fo_jax.model.dsa import init_params  # noqa: E402
from fo_jax.offload import decode as offload_decode  # noqa: E402
from fo_jax.offload.config import HOST_ACCESS, OffloadConfig  # noqa: E402
from fo_jax.offload.manage import manage_group  # noqa: E402


# Management ---------------------------------------------------------------------------------

def _selections(rng, count, batch, ways, k, context, fresh_from, hit_fraction):
    """[count, B, W, K] per-step selections that give every hot-cache size the same misses.

    Each way's first step takes `hit_fraction` of its k tokens from [0, k W) (resident in
    every cell's initial fill, C >= k W) and each later step from the previous step's
    selections (resident after that step, whatever the policy and C); the other k - hits
    are fresh tokens from [fresh_from, context), never selected before and never in any
    initial fill (fresh_from >= the largest C). So every step of every cell misses exactly
    W (k - hits) distinct tokens per request.
    """
    n_hit = int(k * hit_fraction)
    n_new = k - n_hit
    supply = context - fresh_from
    if count * ways * n_new > supply:
        raise ValueError(
            f"{count} steps of {ways} x {n_new} fresh misses need {count * ways * n_new} "
            f"never-selected tokens, but [{fresh_from}, {context}) holds {supply}: raise "
            "--mgmt-context or lower --rounds / --inner")
    out = np.empty((count, batch, ways, k), np.int32)
    for b in range(batch):
        fresh = fresh_from + rng.permutation(supply).astype(np.int32)
        previous = np.arange(k * ways, dtype=np.int32)
        used = 0
        for t in range(count):
            for w in range(ways):
                warm = rng.choice(previous, n_hit, replace=False)
                new = fresh[used:used + n_new]
                used += n_new
                out[t, b, w] = np.sort(np.concatenate([warm, new]))
            previous = np.unique(out[t, b])
    return out


@functools.partial(jax.jit, static_argnames=("policy", "hot_slots"),
                   donate_argnames=("slots", "policy_state"))
def _manage_steps(selections, slots, policy_state, first_step, *, policy, hot_slots):
    """One management step per selection [N, B, W, K] in one program (so the per-step time is
    the management itself, not Python dispatch); returns (slots, policy state, misses copied,
    a checksum of the plans that keeps them from being optimized away)."""
    tail_start = jnp.full((selections.shape[1],), 2**30, jnp.int32)  # no tail tokens here

    def body(i, carry):
        slots, policy_state, misses, total = carry
        tokens = selections[i]
        plan, stats, slots, policy_state = manage_group(
            tokens, tokens >= 0, slots, policy_state, 0, tail_start, first_step + i,
            policy=policy, hot_slots=hot_slots, page_size=16)
        return (slots, policy_state, misses + jnp.sum(stats.union),
                total + jnp.sum(plan.read_row))

    return jax.lax.fori_loop(0, selections.shape[0], body,
                             (slots, policy_state, jnp.int32(0), jnp.int32(0)))


def _management_state(policy, hot, batch, context, seed):
    """One group's state with a full cache: slot i holds token i; nothing protected yet."""
    t2s = np.full((1, batch, context), -1, np.int32)
    t2s[:, :, :hot] = np.arange(hot)
    s2t = np.broadcast_to(np.arange(hot, dtype=np.int32), (1, batch, hot)).copy()
    last = np.zeros((1, batch, hot if policy == "lru" else 0), np.int32)
    slots = (jnp.asarray(t2s), jnp.asarray(s2t))
    ref = jnp.zeros((1, batch, hot if policy == "clock" else 0), jnp.int8)
    policy_state = (jnp.full((1, batch, hot), -1, jnp.int32), jnp.zeros((1, batch), jnp.int32),
                    jnp.asarray(last), ref, jax.random.key_data(jax.random.key(seed)))
    return slots, policy_state


def _spread(values):
    """(median, 25th percentile, 75th percentile, min, max)."""
    q25, q50, q75 = np.percentile(values, [25, 50, 75])
    return float(q50), float(q25), float(q75), float(np.min(values)), float(np.max(values))


def bench_management(cells, *, batch, ways, k, context, rounds, warmup_rounds, inner,
                     seed=0, hit_fraction=0.9):
    """Per-step seconds of each (policy, C) cell, timed in interleaved rounds.

    Every round times `inner` management steps of every cell, one cell after the other
    (A B C ..., then ... C B A: no cell is always first), all cells on the same selections,
    so machine noise and drift hit every cell alike and every cell copies the same misses
    (checked). Returns {cell: {"seconds": per-round seconds per step, "misses_per_step":
    misses per request per step}}.
    """
    rng = np.random.default_rng(seed)
    fresh_from = max(hot for _, hot in cells)
    selections = _selections(rng, (warmup_rounds + rounds) * inner, batch, ways, k, context,
                             fresh_from, hit_fraction)
    chunks = [jnp.asarray(selections[r * inner:(r + 1) * inner])
              for r in range(warmup_rounds + rounds)]
    boxes = {cell: {"state": _management_state(*cell, batch, context, seed), "step": 1,
                    "seconds": [], "misses": []} for cell in cells}
    for r, chunk in enumerate(chunks):
        for policy, hot in (cells if r % 2 == 0 else cells[::-1]):
            box = boxes[(policy, hot)]
            start = time.perf_counter()
            slots, policy_state, misses, total = _manage_steps(
                chunk, *box["state"], jnp.int32(box["step"]), policy=policy, hot_slots=hot)
            jax.block_until_ready((slots, policy_state, misses, total))
            elapsed = time.perf_counter() - start
            box["state"], box["step"] = (slots, policy_state), box["step"] + inner
            if r >= warmup_rounds:
                box["seconds"].append(elapsed / inner)
                box["misses"].append(int(misses))
    misses = {cell: tuple(box["misses"]) for cell, box in boxes.items()}
    if len(set(misses.values())) != 1:
        raise AssertionError(f"cells copied different misses per round: {misses}")
    return {cell: {"seconds": box["seconds"],
                   "misses_per_step": sum(box["misses"]) / (rounds * inner * batch)}
            for cell, box in boxes.items()}


def run_management(args, meta):
    k, ways, batch = args.k, args.ways, args.batch[0]
    sizes = [m * k for m in args.multiples]
    cells = [(policy, c) for policy in args.policies for c in sizes]
    result = bench_management(cells, batch=batch, ways=ways, k=k,
                              context=args.mgmt_context, rounds=args.rounds,
                              warmup_rounds=args.warmup_rounds, inner=args.inner)
    misses = result[cells[0]]["misses_per_step"]
    print(f"\nmanagement per step: k={k}, W={ways}, batch={batch}, "
          f"context={args.mgmt_context}; {misses:g} misses per request per step in every cell; "
          f"{args.rounds} interleaved rounds (+{args.warmup_rounds} warm-up) of {args.inner} "
          "steps per cell")
    print(f"{'policy':7s}{'C':>7s}{'median ms':>11s}{'IQR ms':>17s}{'min-max ms':>17s}"
          f"   ratio to C={sizes[0]}: median [IQR] [min-max] of per-round ratios")
    rows = []
    for policy in args.policies:
        base = np.asarray(result[(policy, sizes[0])]["seconds"])
        for c in sizes:
            seconds = np.asarray(result[(policy, c)]["seconds"])
            med, q25, q75, lo, hi = _spread(seconds)
            ratio, r25, r75, rlo, rhi = _spread(seconds / base)  # paired within each round
            print(f"{policy:7s}{c:>7d}{med * 1e3:>11.3f}{q25 * 1e3:>8.3f}-{q75 * 1e3:<8.3f}"
                  f"{lo * 1e3:>8.3f}-{hi * 1e3:<8.3f}   {ratio:.2f}x [{r25:.2f}-{r75:.2f}] "
                  f"[{rlo:.2f}-{rhi:.2f}]")
            rows.append({**meta, "question": "management", "policy": policy, "hot_slots": c,
                         "k": k, "ways": ways, "batch": batch,
                         "context": args.mgmt_context, "seconds": med, "seconds_q25": q25,
                         "seconds_q75": q75, "seconds_min": lo, "seconds_max": hi,
                         "ratio": ratio, "ratio_q25": r25, "ratio_q75": r75,
                         "ratio_min": rlo, "ratio_max": rhi, "rounds": args.rounds,
                         "inner": args.inner, "round_seconds": seconds.tolist(),
                         "misses_per_step": result[(policy, c)]["misses_per_step"]})
    return rows


# Whole step ---------------------------------------------------------------------------------

WORKLOADS = {
    # name: fraction of tokens the indexer favours (see common.synthetic_states)
    "locality": None,  # --heavy (default 0.1): a working set smaller than the hot cache
    "uniform": 0.0,    # uniform keys: every step's top-k an independent draw, hit rate ~ C / S
}


def run_step(args, meta):
    config = get_config(args.model)
    config = dataclasses.replace(config, max_ways=args.ways)
    if args.smoke:  # one indexer group (each group is its own code in every program)
        config = config.replace(name=f"{config.name}-1group", indexer_layers=(0,))
    context = args.context
    hot = max(context // 4, config.index_topk * args.ways)
    page = 64 if hot >= 64 else 16
    capacity = -(-(context + (args.warmup + args.steps + 8) * args.ways) // page) * page
    offloads = {policy: OffloadConfig(hot_slots=hot, page_size=page, capacity=capacity,
                                      policy=policy, miss_chunk=args.miss_chunk,
                                      host_access=args.host_access)
                for policy in args.policy}
    params = init_params(config, jax.random.key(0))
    access = next(iter(offloads.values())).host_access
    rows = []
    for batch in args.batch:
        print(f"\nwhole decode step: {config.name}, batch {batch}, W {args.ways}, context "
              f"{context}, C {hot} ({', '.join(offloads)}), host_access {access}, backend "
              f"{meta['backend']}; {args.steps} timed steps after {args.warmup} warm-up steps, "
              "the paths alternating step by step; median [IQR] of per-step times and of "
              "paired ratios")
        got = []
        for workload in args.workloads:
            heavy = args.heavy if WORKLOADS[workload] is None else WORKLOADS[workload]
            got += _bench_step(args, meta, config, offloads, params, workload, heavy, batch)
        write_jsonl(args.out, got)  # batch by batch: a batch cut short loses no other
        rows += got
    return rows


def _bench_step(args, meta, config, offloads, params, workload, heavy, batch):
    """Resident and each policy's offloaded step, alternating step by step on the same
    tokens and state contents; one row per policy (its ratio to resident, and to the first
    policy, both paired within each step)."""
    context = args.context
    states = {policy: synthetic_states(config, offload, batch, context, seed=1, heavy=heavy)
              for policy, offload in offloads.items()}
    first = next(iter(offloads))
    rng = np.random.default_rng(2)
    total = args.warmup + args.steps + 2
    tokens = [jnp.asarray(rng.integers(0, config.vocab_size, (batch, args.ways), np.int32))
              for _ in range(total)]
    box = {"res": states[first][0], "i": 0,
           "dec": {policy: dec for policy, (_, dec) in states.items()},
           "stats": {policy: [] for policy in offloads}}

    def resident_step():
        logits, box["res"] = resident.decode_step(params, box["res"], tokens[box["i"]],
                                                  config=config, check=False)
        logits.block_until_ready()

    def offload_step(policy):
        logits, box["dec"][policy], stats = offload_decode.decode_step(
            params, box["dec"][policy], tokens[box["i"]], config=config,
            offload=offloads[policy], check=False)
        logits.block_until_ready()
        box["stats"][policy].append(stats)

    # Alternate the paths step by step so all see the same machine noise; the first `warmup`
    # steps (compilation, hot-cache warm-up from the initial fill) are not counted.
    t_res, t_off = [], {policy: [] for policy in offloads}
    for i in range(total):
        box["i"] = i
        t_res.append(median_time(resident_step, warmup=0, repeats=1))
        for policy in offloads:
            t_off[policy].append(median_time(functools.partial(offload_step, policy),
                                             warmup=0, repeats=1))
    skip = args.warmup + 2
    t_res = np.asarray(t_res[skip:])
    res_med, res_q25, res_q75, _, _ = _spread(t_res)
    print(f"  {workload} (heavy fraction {heavy}): resident {res_med * 1e3:.2f} ms "
          f"[{res_q25 * 1e3:.2f}-{res_q75 * 1e3:.2f}], device KV state "
          f"{box['res'].device_bytes() / 1e6:.1f} MB")
    rows = []
    for policy in offloads:
        times = np.asarray(t_off[policy][skip:])
        off_med, off_q25, off_q75, _, _ = _spread(times)
        ratio, r25, r75, rlo, rhi = _spread(times / t_res)
        to_first = _spread(times / np.asarray(t_off[first][skip:]))[0]
        stats = box["stats"][policy][skip:]
        hits = sum(int(s.hits.sum()) for s in stats)
        tail = sum(int(s.tail_hits.sum()) for s in stats)
        misses = sum(int(s.misses.sum()) for s in stats)
        hit_rate = (hits + tail) / max(hits + tail + misses, 1)
        print(f"    {policy}: offloaded {off_med * 1e3:.2f} ms [{off_q25 * 1e3:.2f}-"
              f"{off_q75 * 1e3:.2f}]   ratio to resident {ratio:.3f} [IQR {r25:.3f}-{r75:.3f}, "
              f"min-max {rlo:.3f}-{rhi:.3f}]   ratio to {first} {to_first:.3f}   hit rate "
              f"{hit_rate:.3f} ({misses / max(len(stats) * batch, 1):.0f} misses per request "
              f"per step), device KV state {box['dec'][policy].device_bytes() / 1e6:.1f} MB")
        rows.append({**meta, "question": "step", "model": config.name, "batch": batch,
                     "ways": args.ways, "context": context,
                     "hot_slots": offloads[policy].hot_slots, "policy": policy,
                     "host_access": offloads[policy].host_access,
                     "workload": workload, "heavy": heavy, "resident_s": res_med,
                     "resident_q25": res_q25, "resident_q75": res_q75, "offload_s": off_med,
                     "offload_q25": off_q25, "offload_q75": off_q75, "ratio": ratio,
                     "ratio_q25": r25, "ratio_q75": r75, "ratio_min": rlo, "ratio_max": rhi,
                     f"ratio_to_{first}": to_first, "hit_rate": hit_rate,
                     "steps": len(stats)})
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--what", choices=("management", "step", "both"), default="both")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--ways", type=int, default=1)
    parser.add_argument("--batch", type=int, nargs="+", default=[4],
                        help="step: the batches timed in turn; management: one batch")
    parser.add_argument("--host-access", default=None, choices=HOST_ACCESS,
                        help="step: how the offloaded step moves rows (default: the backend's)")
    parser.add_argument("--multiples", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--mgmt-context", type=int, default=131072)
    parser.add_argument("--model", default="small")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--policy", nargs="+", default=["ring"], choices=("ring", "clock"),
                        help="step: the hot-cache policies to time (each against resident)")
    parser.add_argument("--policies", nargs="+", default=["ring", "clock", "lru"],
                        choices=("ring", "clock", "lru", "random"),
                        help="management: the policies to time")
    parser.add_argument("--miss-chunk", type=int, default=64, help="host rows per copy")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=20, help="uncounted decode steps")
    parser.add_argument("--heavy", type=float, default=0.1,
                        help="fraction of tokens the indexer favours in the 'locality' workload")
    parser.add_argument("--workloads", nargs="+", choices=tuple(WORKLOADS),
                        default=list(WORKLOADS), help="step benchmark workloads")
    parser.add_argument("--rounds", type=int, default=15,
                        help="management: timed interleaved rounds (each cell once per round)")
    parser.add_argument("--warmup-rounds", type=int, default=1,
                        help="management: uncounted rounds (compilation, first steps)")
    parser.add_argument("--inner", type=int, default=20,
                        help="management: steps per cell per round, in one program")
    parser.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.k, args.batch, args.mgmt_context, args.rounds, args.inner = 16, [2], 2048, 3, 4
        args.model, args.context, args.steps, args.ways = "tiny", 200, 3, 2
        args.warmup, args.multiples = 2, [2, 4]  # each (policy, C) compiles its own program
    if args.what != "step" and len(args.batch) > 1:
        parser.error(f"--batch {' '.join(map(str, args.batch))}: the management benchmark "
                     "takes one batch (run --what step for several)")
    if args.what != "step" and min(args.multiples) < args.ways:
        parser.error(f"C = {min(args.multiples)}k < k * W = {args.ways}k: every step's "
                     "selections must fit the hot cache; raise --multiples or lower --ways")
    meta = run_metadata()
    rows = []
    if args.what in ("management", "both"):
        rows += run_management(args, meta)
        write_jsonl(args.out, rows)
    if args.what in ("step", "both"):
        rows += run_step(args, meta)  # appends its rows batch by batch
    return rows


if __name__ == "__main__":
    main()
