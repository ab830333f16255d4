"""Eviction policies against cache budgets: misses per step, hit rate, bytes moved.

For each policy (ring, lru, random) and hot-cache budget C (multiples of k * W), run the
offloaded decode step from the same synthetic history (a `heavy` fraction of tokens the indexer
favours: a working set, as real long-context sessions have) with the same tokens, and report,
after a warm-up, the misses per request per group per step (W ways united), the hit rate, and
the H2D bytes per generated token. Losslessness does not depend on the policy (the tests check
every policy bit for bit); this measures only what each policy costs in copies.

    python -m experiments.traces.eviction_policies [--model small --context 16384 --steps 20]
    python -m experiments.traces.eviction_policies --smoke        # seconds; run by the tests
    python -m experiments.traces.plot_eviction_policies results/eviction_policies.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import run_metadata, synthetic_states, write_jsonl  # noqa: E402

from fo_jax.config import get_config  # noqa: E402
from fo_jax.model.dsa import init_params  # noqa: E402
from fo_jax.offload import decode as offload_decode  # noqa: E402
from fo_jax.offload.config import OffloadConfig  # noqa: E402


def run_cell(config, params, policy, hot, args, tokens):
    page = 16
    capacity = -(-(args.context + len(tokens) * args.ways) // page) * page
    offload = OffloadConfig(hot_slots=hot, page_size=page, capacity=capacity, policy=policy)
    _, state = synthetic_states(config, offload, args.batch, args.context, seed=1,
                                heavy=args.heavy)
    union, hits, selected, h2d = [], 0, 0, 0.0
    for i, step_tokens in enumerate(tokens):
        _, state, stats = offload_decode.decode_step(params, state, step_tokens, config=config,
                                                     offload=offload, check=False)
        if i >= args.warmup:
            union.append(np.asarray(stats.union))  # [G, B]
            hits += int(stats.hits.sum() + stats.tail_hits.sum())
            selected += int(stats.hits.sum() + stats.tail_hits.sum() + stats.misses.sum())
            h2d += float(stats.h2d_bytes.astype(jnp.float32).sum())
    counted = len(tokens) - args.warmup
    return {
        "misses_per_request_group_step": float(np.mean(union)),
        "hit_rate": hits / max(selected, 1),
        "h2d_bytes_per_token": h2d / (counted * args.batch * args.ways),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--ways", type=int, default=2)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--multiples", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--policies", nargs="+", default=["ring", "lru", "random"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--heavy", type=float, default=0.05)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args(argv)
    if args.smoke:
        # One budget (C = k * W: the tightest, every step evicts) and every policy: each
        # policy is its own compiled decode step, the budget only changes shapes.
        args.model, args.context, args.steps, args.warmup = "tiny", 300, 4, 2
        args.multiples = [1]
    config = dataclasses.replace(get_config(args.model), max_ways=args.ways)
    if args.smoke:  # one indexer group (each group is its own code in the decode step)
        config = config.replace(name=f"{config.name}-1group", indexer_layers=(0,))
    params = init_params(config, jax.random.key(0))
    rng = np.random.default_rng(2)
    tokens = [jnp.asarray(rng.integers(0, config.vocab_size, (args.batch, args.ways), np.int32))
              for _ in range(args.warmup + args.steps)]
    meta = run_metadata()
    base = config.index_topk * args.ways
    rows = []
    print(f"{config.name}: batch {args.batch}, W {args.ways}, k {config.index_topk}, context "
          f"{args.context}, heavy fraction {args.heavy}; misses / request / group / step "
          "(hit rate)")
    print(f"{'policy':8s}" + "".join(f"{f'C={m * base}':>20s}" for m in args.multiples))
    for policy in args.policies:
        cells = [run_cell(config, params, policy, m * base, args, tokens)
                 for m in args.multiples]
        print(f"{policy:8s}" + "".join(
            f"{c['misses_per_request_group_step']:11.1f} ({c['hit_rate']:.3f})"
            for c in cells))
        for m, cell in zip(args.multiples, cells):
            rows.append({**meta, "question": "eviction", "model": config.name,
                         "policy": policy, "hot_slots": m * base, "batch": args.batch,
                         "ways": args.ways, "context": args.context, "heavy": args.heavy,
                         **cell})
    write_jsonl(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
