"""The serving engine on this machine's backend: offloaded tokens against resident, bit for bit.

Serves the same requests (mixed prompt and output lengths, greedy, arriving together so that
seats prefill and decode side by side) through the resident engine and through the offloaded
engine (shared page pool, a hot cache smaller than the contexts so decoding misses, prefix
cache on, requests sharing a prompt prefix), and compares every request's tokens. Prints the
first token where a request parts, and each engine's wall time and step counters; appends one
JSON line to `--out`. `--host-access` chooses how the offloaded engine moves rows (default:
the backend's, `fo_jax.offload.config.default_host_access`).

    python -m experiments.accelerator.engine_check                  # the embedded trained model
    python -m experiments.accelerator.engine_check --host-access ffi
    python -m experiments.accelerator.engine_check --smoke          # tiny random model (the tests)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

from experiments.common import run_metadata, write_jsonl  # noqa: E402

from fo_jax.config import get_config  # noqa: E402
from fo_jax.embedded import embedded_available, load_embedded  # noqa: E402
from fo_jax.engine import Engine  # noqa: E402
from fo_jax.model.dsa import init_params  # noqa: E402
from fo_jax.offload.config import HOST_ACCESS, OffloadConfig  # noqa: E402


def requests(vocab: int, count: int, seed: int, prompt_len, output_len, prefix_len: int):
    """`count` (prompt, max_tokens): half of them start with one shared prefix."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab, prefix_len).tolist()
    out = []
    for i in range(count):
        body = rng.integers(0, vocab, int(rng.integers(*prompt_len))).tolist()
        out.append(((prefix if i % 2 else []) + body, int(rng.integers(*output_len))))
    return out


def serve(engine: Engine, reqs) -> tuple[dict, float]:
    ids = [engine.add_request(p, max_tokens=m) for p, m in reqs]
    start = time.perf_counter()
    outs = engine.run()
    return {i: outs[i].token_ids for i in ids}, time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny random model (seconds)")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--seats", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=512)
    parser.add_argument("--hot-slots", type=int, default=None,
                        help="default: the smallest the model allows (misses)")
    parser.add_argument("--steps-per-call", type=int, default=4)
    parser.add_argument("--host-access", default=None, choices=HOST_ACCESS,
                        help="the offloaded engine's (default: the backend's)")
    parser.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args(argv)
    if args.smoke or not embedded_available():
        config = get_config("tiny")
        if args.smoke:  # one indexer group (each group is its own code in every program)
            config = config.replace(name="tiny-1group", indexer_layers=(0,))
        params = init_params(config, jax.random.key(0))
        model = f"{config.name} (random)"
        args.capacity = min(args.capacity, 128)
        prompt_len, output_len, prefix_len, chunk, page = (3, 40), (2, 12), 32, 16, 8
    else:
        config, params, _ = load_embedded()
        model = config.name
        prompt_len, output_len, prefix_len, chunk, page = (8, 200), (8, 64), 128, 64, 16
    hot = args.hot_slots or config.index_topk * config.max_ways
    reqs = requests(config.vocab_size, args.requests, 0, prompt_len, output_len, prefix_len)
    common_args = dict(seats=args.seats, decode_steps_per_call=args.steps_per_call,
                       prefill_chunk=chunk)
    resident_engine = Engine(params, config, capacity=args.capacity, **common_args)
    want, resident_s = serve(resident_engine, reqs)
    offload = OffloadConfig(hot_slots=hot, page_size=page, capacity=args.capacity,
                            host_access=args.host_access)
    offload_engine = Engine(params, config, offload=offload, prefix_cache=True, **common_args)
    got, offload_s = serve(offload_engine, reqs)
    parted = {}
    for rid, tokens in want.items():
        other = got[rid]
        if tokens != other:
            parted[rid] = next((i for i, (a, b) in enumerate(zip(tokens, other)) if a != b),
                               min(len(tokens), len(other)))
    stats = offload_engine.stats
    hits = misses = None
    if stats is not None:
        hits, misses = int(np.sum(stats.hits)), int(np.sum(stats.misses))
    row = {**run_metadata(), "model": model, "requests": len(reqs), "seats": args.seats,
           "capacity": args.capacity, "hot_slots": hot, "host_access": offload.host_access,
           "tokens": sum(len(t) for t in want.values()), "equal": not parted,
           "parted_at": parted, "resident_s": resident_s, "offload_s": offload_s,
           "hits": hits, "misses": misses,
           "prefix_hit_tokens": offload_engine.counters["prefix_hit_tokens"],
           "pool_after": offload_engine.pool_occupancy()}
    print(f"engine check on {row['backend']} ({row['device']}), jax {jax.__version__}: {model}, "
          f"{len(reqs)} requests, {args.seats} seats, C={hot}, host_access "
          f"{offload.host_access}")
    print(f"  tokens equal: {row['equal']} ({row['tokens']} tokens"
          + (f"; parted: {parted}" if parted else "") + ")")
    print(f"  resident {resident_s:.2f} s, offloaded {offload_s:.2f} s "
          f"(x{offload_s / resident_s:.2f}, compiles included); hits {hits}, misses {misses}, "
          f"prefix tokens reused {row['prefix_hit_tokens']}; pool after {row['pool_after']}")
    write_jsonl(args.out, [row])
    return row


if __name__ == "__main__":
    main()
