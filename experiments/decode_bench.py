"""Decode-offload benchmark: management cost vs hot-cache size, and the whole step vs resident.

Two questions, one run (ratios are to baselines measured in the same run; these machines are
noisy, absolute times are not stable):

  management  per-step time of one group's management (`manage_group`: lookup, union, victims,
              map updates) at C = 2k, 4k, 8k, 16k with fixed k, W and context, for the default
              ring policy and for LRU, as ratios to the smallest C. The ring policy touches
              O(K W + misses) entries and must stay flat; LRU takes an argmin over C and grows.
  step        the whole offloaded decode step against the resident decode step on the `small`
              preset (batch 4-8, long context, C = a quarter of the context), same tokens,
              same state contents (synthetic: random KV rows and indexer keys, so no
              multi-hour CPU prefill is needed; both paths compute exactly the same logits).

    python experiments/decode_bench.py                       # both, CPU sizes
    python experiments/decode_bench.py --what step --batch 16 --context 65536   # the GPU run
    python experiments/decode_bench.py --smoke               # seconds; run by the tests
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __import__("os").path.dirname(__file__))
from common import median_time, run_metadata, synthetic_states, write_jsonl  # noqa: E402

from fo_jax import resident  # noqa: E402
from fo_jax.config import get_config  # noqa: E402
from fo_jax.model.dsa import init_params  # noqa: E402
from fo_jax.offload import decode as offload_decode  # noqa: E402
from fo_jax.offload.config import OffloadConfig  # noqa: E402
from fo_jax.offload.manage import manage_group  # noqa: E402


# Management ---------------------------------------------------------------------------------

def _selections(rng, count, batch, ways, k, context, hot, hit_fraction):
    """Per-step selections: `hit_fraction` of each way from the initially resident tokens
    [0, hot), the rest from the cold tokens [hot, context); sorted, unique per way."""
    out = []
    n_hit = int(k * hit_fraction)
    for _ in range(count):
        sel = np.empty((batch, ways, k), np.int32)
        for b in range(batch):
            for w in range(ways):
                warm = rng.choice(hot, n_hit, replace=False)
                cold = hot + rng.choice(context - hot, k - n_hit, replace=False)
                sel[b, w] = np.sort(np.concatenate([warm, cold]))
        out.append(jnp.asarray(sel))
    return out


@functools.partial(jax.jit, static_argnames=("policy", "hot_slots", "steps"),
                   donate_argnames=("slots", "policy_state"))
def _manage_steps(selections, slots, policy_state, first_step, *, policy, hot_slots, steps):
    """`steps` management steps in one program (cycling through `selections` [N, B, W, K]),
    so the per-step time is the management itself, not Python dispatch."""
    tail_start = jnp.full((selections.shape[1],), 2**30, jnp.int32)  # no tail tokens here

    def body(i, carry):
        slots, policy_state, total = carry
        tokens = selections[i % selections.shape[0]]
        plan, stats, slots, policy_state = manage_group(
            tokens, tokens >= 0, slots, policy_state, 0, tail_start, first_step + i,
            policy=policy, hot_slots=hot_slots, page_size=16)
        return slots, policy_state, total + jnp.sum(plan.read_row) + jnp.sum(stats.union)

    return jax.lax.fori_loop(0, steps, body, (slots, policy_state, jnp.int32(0)))


def bench_management(policy, hot, *, batch, ways, k, context, steps, seed=0, inner=20):
    """Median seconds of one group's management step at hot-cache size `hot`."""
    rng = np.random.default_rng(seed)
    t2s = np.full((1, batch, context), -1, np.int32)
    t2s[:, :, :hot] = np.arange(hot)
    s2t = np.broadcast_to(np.arange(hot, dtype=np.int32), (1, batch, hot)).copy()
    last = np.zeros((1, batch, hot if policy == "lru" else 0), np.int32)
    box = {
        "slots": (jnp.asarray(t2s), jnp.asarray(s2t)),
        "state": (jnp.full((1, batch, hot), -1, jnp.int32), jnp.zeros((1, batch), jnp.int32),
                  jnp.asarray(last), jax.random.key_data(jax.random.key(seed))),
        "step": 1,
    }
    selections = jnp.stack(_selections(rng, 8, batch, ways, k, context, hot, 0.9))

    def run():
        box["slots"], box["state"], total = _manage_steps(
            selections, box["slots"], box["state"], jnp.int32(box["step"]), policy=policy,
            hot_slots=hot, steps=inner)
        box["step"] += inner
        total.block_until_ready()

    return median_time(run, warmup=2, repeats=steps) / inner


def run_management(args, meta):
    rows = []
    k, ways = args.k, args.ways
    sizes = [m * k for m in args.multiples]
    print(f"\nmanagement per step: k={k}, W={ways}, batch={args.batch}, "
          f"context={args.mgmt_context}")
    print(f"{'policy':8s}" + "".join(f"{f'C={c}':>20s}" for c in sizes))
    for policy in ("ring", "lru"):
        times = [bench_management(policy, c, batch=args.batch, ways=ways, k=k,
                                  context=args.mgmt_context, steps=args.repeats)
                 for c in sizes]
        base = times[0]
        print(f"{policy:8s}" + "".join(f"{t * 1e3:10.3f} ms ({t / base:4.2f}x)"
                                       for t in times))
        for c, t in zip(sizes, times):
            rows.append({**meta, "question": "management", "policy": policy, "hot_slots": c,
                         "k": k, "ways": ways, "batch": args.batch,
                         "context": args.mgmt_context, "seconds": t, "ratio": t / base})
    return rows


# Whole step ---------------------------------------------------------------------------------

def run_step(args, meta):
    config = get_config(args.model)
    config = dataclasses.replace(config, max_ways=args.ways)
    context, batch = args.context, args.batch
    hot = max(context // 4, config.index_topk * args.ways)
    page = 64 if hot >= 64 else 16
    capacity = -(-(context + (args.warmup + args.steps + 8) * args.ways) // page) * page
    offload = OffloadConfig(hot_slots=hot, page_size=page, capacity=capacity,
                            policy=args.policy, miss_chunk=args.miss_chunk)
    params = init_params(config, jax.random.key(0))
    res, dec = synthetic_states(config, offload, batch, context, seed=1, heavy=args.heavy)
    rng = np.random.default_rng(2)
    total = args.warmup + args.steps + 2
    tokens = [jnp.asarray(rng.integers(0, config.vocab_size, (batch, args.ways), np.int32))
              for _ in range(total)]
    box = {"res": res, "dec": dec, "i": 0, "stats": []}

    def resident_step():
        logits, box["res"] = resident.decode_step(params, box["res"], tokens[box["i"]],
                                                  config=config, check=False)
        logits.block_until_ready()

    def offload_step():
        logits, box["dec"], stats = offload_decode.decode_step(
            params, box["dec"], tokens[box["i"]], config=config, offload=offload, check=False)
        logits.block_until_ready()
        box["stats"].append(stats)
        box["i"] += 1

    # Alternate the two paths step by step so both see the same machine noise; the first
    # `warmup` steps (compilation, hot-cache warm-up from the initial fill) are not counted.
    t_res, t_off = [], []
    for i in range(total):
        box["i"] = i
        t_res.append(median_time(resident_step, warmup=0, repeats=1))
        box["i"] = i
        t_off.append(median_time(offload_step, warmup=0, repeats=1))
    skip = args.warmup + 2
    t_res, t_off = float(np.median(t_res[skip:])), float(np.median(t_off[skip:]))
    stats = box["stats"][skip:]
    hits = sum(int(s.hits.sum() + s.tail_hits.sum()) for s in stats)
    misses = sum(int(s.misses.sum()) for s in stats)
    hit_rate = hits / max(hits + misses, 1)
    print(f"\nwhole decode step: {config.name}, batch {batch}, W {args.ways}, context "
          f"{context}, C {hot} ({offload.policy}), backend {meta['backend']}")
    print(f"  resident {t_res * 1e3:.2f} ms   offloaded {t_off * 1e3:.2f} ms   "
          f"ratio {t_off / t_res:.3f}   hit rate {hit_rate:.3f} (synthetic history, "
          f"heavy fraction {args.heavy})")
    print(f"  device KV state: resident {res.device_bytes() / 1e6:.1f} MB, offloaded "
          f"{box['dec'].device_bytes() / 1e6:.1f} MB")
    return [{**meta, "question": "step", "model": config.name, "batch": batch,
             "ways": args.ways, "context": context, "hot_slots": hot, "policy": args.policy,
             "resident_s": t_res, "offload_s": t_off, "ratio": t_off / t_res,
             "hit_rate": hit_rate, "heavy": args.heavy}]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--what", choices=("management", "step", "both"), default="both")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--ways", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--multiples", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--mgmt-context", type=int, default=131072)
    parser.add_argument("--model", default="small")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--policy", default="ring")
    parser.add_argument("--miss-chunk", type=int, default=64, help="host rows per copy")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=20, help="uncounted decode steps")
    parser.add_argument("--heavy", type=float, default=0.1,
                        help="fraction of tokens the indexer favours (temporal locality)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.k, args.batch, args.mgmt_context, args.repeats = 16, 2, 2048, 3
        args.model, args.context, args.steps, args.ways = "tiny", 200, 3, 2
        args.warmup, args.multiples = 2, [2, 4, 8]
    if args.what != "step" and min(args.multiples) < args.ways:
        parser.error(f"C = {min(args.multiples)}k < k * W = {args.ways}k: every step's "
                     "selections must fit the hot cache; raise --multiples or lower --ways")
    meta = run_metadata()
    rows = []
    if args.what in ("management", "both"):
        rows += run_management(args, meta)
    if args.what in ("step", "both"):
        rows += run_step(args, meta)
    write_jsonl(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
