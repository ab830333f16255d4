"""Rank imbalance in the serving engines: DataParallelEngine or ShardedEngine on R devices, by
placement rule.

experiments/traces/rank_imbalance.py simulates placement over replayed miss series; this runs the
real engine (fo_jax.engine.data_parallel: one Engine and one host pool per device, offloaded)
over a synthetic stream of mixed lengths (a share of long prompts among short ones, arriving
as a Poisson process counted in engine steps, so every rule sees the same arrivals at the
same steps) and measures what each rank copied per step: the rows of its seats' miss unions,
summed over indexer groups. Per rule: rows per rank, the spread (sum over steps of the
largest rank's rows / sum of the mean rank's: the step waits for the largest), throughput
(output tokens / wall second), and both against round_robin measured in the same run; per
rank its rows per step, and per step the largest rank's rows over the mean rank's (their mean
over the steps that copied any; every step's rows per rank are kept in the JSON line).

`--engine sharded` runs `fo_jax.engine.sharded.ShardedEngine` offloaded instead: every rank
stepped in one program per step, a host pool per rank, placement by the same rules (its
least_misses reads each decode call's rows per seat); with `--model tiny_moe` in the
all-to-all layout (each device 1/R of the experts), else on the plain data mesh.

On a CPU the R devices are simulated (XLA_FLAGS=--xla_force_host_platform_device_count=R,
set here from --ranks, at least 4, when not given) and share the machine's cores, so the
throughput says how much work there was, not how long an accelerator's step would wait for
its slowest rank: read the spread for that.

    python -m experiments.serving.dp_serving                       # 4 devices, 3 rules, 3 seeds
    python -m experiments.serving.dp_serving \\
        --table experiments/results/serving/dp_serving/dp_serving.jsonl
    python -m experiments.serving.dp_serving --smoke  # 2 ranks on one device; the tests
    python -m experiments.serving.dp_serving --engine sharded --model tiny_moe \\
        --out experiments/results/serving/dp_serving/sharded.jsonl    # 4 simulated devices
    python -m experiments.serving.dp_serving --engine sharded --smoke  # 1 rank; the tests
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _devices_wanted(argv, default=4) -> int:
    """--ranks N of the command line (at least `default`): the simulated CPU devices."""
    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith("--ranks=") else (
            argv[i + 1] if arg == "--ranks" and i + 1 < len(argv) else None)
        if value is not None and value.isdigit():
            return max(int(value), default)
    return default


if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count="
                               + str(_devices_wanted(sys.argv[1:])))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from experiments.common import run_metadata, write_jsonl  # noqa: E402

from fo_jax import sharding  # noqa: E402
from fo_jax.config import get_config  # noqa: E402
from fo_jax.engine.data_parallel import DataParallelEngine  # noqa: E402
from fo_jax.engine.sharded import ShardedEngine  # noqa: E402
from fo_jax.model.dsa import init_params  # noqa: E402
from fo_jax.offload.config import OffloadConfig  # noqa: E402

DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "..", "results",
                           "serving", "dp_serving",
                           "dp_serving.jsonl")


def stream(num, *, rate, short, long, long_share, output_len, vocab, seed):
    """[(arrival step, prompt ids, max_tokens)]: Poisson arrivals of `rate` requests per
    step; a share `long_share` of prompts of `long` tokens (an inclusive range), the others
    of `short`; outputs uniform in `output_len`."""
    rng = np.random.default_rng(seed)
    steps = np.floor(np.cumsum(rng.exponential(1.0 / rate, num))).astype(int)
    steps -= steps[0]
    out = []
    for t in steps:
        lo, hi = long if rng.random() < long_share else short
        prompt = rng.integers(0, vocab, int(rng.integers(lo, hi + 1))).tolist()
        out.append((int(t), prompt, int(rng.integers(output_len[0], output_len[1] + 1))))
    return out


def serve(engine, requests):
    """Warm every rank up (untimed), then feed `requests` at their steps and step until all
    finish: (figures, {request index: token ids})."""
    longest = max((p for _, p, _ in requests), key=len)
    warm = [engine.add_request(longest[::-1], max_tokens=2, rank=r)
            for r in range(engine.ranks)]
    engine.run()
    for rid in warm:
        engine.release(rid)
    engine.reset_figures()
    pending, ids, step = list(enumerate(requests)), {}, 0
    per_step, seen = [], np.zeros(engine.ranks, np.int64)  # [steps, R] rows copied
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, max_tokens) = pending.pop(0)
            ids[i] = engine.add_request(prompt, max_tokens=max_tokens)
        engine.step()
        now = np.asarray(engine.rank_misses(), np.int64)
        per_step.append((now - seen).tolist())
        seen = now
        step += 1
    wall = time.perf_counter() - start
    outputs = engine.run()
    tokens = {i: outputs[rid].token_ids for i, rid in ids.items()}
    imbalance = engine.imbalance()
    misses = imbalance["rank_misses"]
    figures = {"wall_s": wall, "steps": step,
               "output_tokens": sum(len(t) for t in tokens.values()),
               "rank_misses": misses, "placed_per_rank": imbalance["placed_per_rank"],
               "spread": imbalance["max_over_mean"],
               "total_spread": max(misses) / max(np.mean(misses), 1e-12),
               "pool_held": engine.pool_occupancy()["held"], **per_step_figures(per_step)}
    figures["tokens_per_s"] = figures["output_tokens"] / wall
    for rid in ids.values():
        engine.release(rid)
    return figures, tokens


def per_step_figures(per_step) -> dict:
    """Figures of the rows each rank copied per step ([steps][R]): each rank's mean rows per
    step, the mean over the steps that copied any of the step's largest rank / mean rank, and
    the steps' rows themselves."""
    rows = np.asarray(per_step, np.float64).reshape(len(per_step), -1)
    busy = rows[rows.sum(axis=1) > 0]
    ratios = busy.max(axis=1) / busy.mean(axis=1) if len(busy) else np.ones(1)
    return {"rank_rows_per_step": rows.mean(axis=0).tolist() if len(rows) else [],
            "step_spread_mean": float(ratios.mean()), "steps_copying": int(len(busy)),
            "rank_rows_steps": [[int(x) for x in r] for r in rows]}


def table(rows) -> str:
    """Per seed and rule (and the mean over seeds): requests and rows per rank, the spread,
    steps and throughput, each against round_robin of the same seed."""
    lines = ["| seed | rule | requests per rank | rows copied per rank | rows per step, per "
             "rank | largest / mean rank, per step | vs round robin | mean of the steps' "
             "largest / mean | steps | tokens / s | vs round robin |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {r["seed"]: r for r in rows if r["rule"] == "round_robin"}
    ratios = {}
    for r in rows:
        b = base.get(r["seed"])
        spread = r["spread"] / b["spread"] if b else None
        speed = r["tokens_per_s"] / b["tokens_per_s"] if b else None
        ratios.setdefault(r["rule"], []).append((r["spread"], spread, speed))
        lines.append(f"| {r['seed']} | {r['rule']} | {r['placed_per_rank']} | "
                     f"{r['rank_misses']} | "
                     f"{[round(x, 1) for x in r.get('rank_rows_per_step', [])]} | "
                     f"{r['spread']:.3f} | {'-' if spread is None else f'{spread:.2f}x'} | "
                     f"{_fixed(r.get('step_spread_mean'))} | {r['steps']} | "
                     f"{r['tokens_per_s']:.1f} | {'-' if speed is None else f'{speed:.2f}x'} |")
    if len(base) > 1:
        for rule, got in ratios.items():
            if all(g[1] is not None for g in got):
                mean = np.mean(np.asarray(got), axis=0)
                lines.append(f"| mean | {rule} | | | | {mean[0]:.3f} | {mean[1]:.2f}x | | | "
                             f"| {mean[2]:.2f}x |")
    return "\n".join(lines)


def _fixed(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("data_parallel", "sharded"),
                        default="data_parallel",
                        help="DataParallelEngine (an Engine per device) or ShardedEngine "
                             "(every rank in one program per step)")
    parser.add_argument("--model", default="tiny",
                        help="tiny, or tiny_moe (with --engine sharded: the experts split over "
                             "the ranks)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--same-device", action="store_true",
                        help="every rank on the first device (a test of the script)")
    parser.add_argument("--rules", nargs="+",
                        default=["round_robin", "least_context", "least_misses"])
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--rate", type=float, default=1.0, help="arrivals per engine step")
    parser.add_argument("--short", type=int, nargs=2, default=[16, 48])
    parser.add_argument("--long", type=int, nargs=2, default=[160, 224])
    parser.add_argument("--long-share", type=float, default=0.25)
    parser.add_argument("--output-len", type=int, nargs=2, default=[16, 48])
    parser.add_argument("--seats", type=int, default=3, help="per rank")
    parser.add_argument("--capacity", type=int, default=256)
    parser.add_argument("--hot-slots", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--decode-steps-per-call", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--table", default=None, help="print the table of these JSON lines")
    parser.add_argument("--out", default=None,
                        help="append JSON lines here (default: results/dp_serving/"
                             "dp_serving.jsonl; none with --smoke)")
    args = parser.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        print(table(rows))
        return rows
    if args.out is None and not args.smoke:
        args.out = DEFAULT_OUT
    config = get_config(args.model).replace(max_ways=1)
    if args.smoke:  # tests/engine/test_engine.py's small engine: two ranks on one device
        config = config.replace(num_layers=2, indexer_layers=(0,), index_topk=4)
        args.ranks, args.same_device, args.requests, args.rate = 2, True, 6, 2.0
        if args.engine == "sharded":  # one rank per device: the test process has one
            args.ranks, args.same_device = 1, False
        args.short, args.long, args.output_len, args.seats = [2, 6], [20, 24], [2, 5], 2
        args.capacity, args.hot_slots, args.page_size = 32, 8, 4
        args.decode_steps_per_call = 2
        args.rules, args.seeds = ["round_robin", "least_misses"], [0]
    devices = jax.local_devices()
    if args.same_device and args.engine == "sharded":
        parser.error("--same-device: the sharded engine holds one rank per device")
    if args.same_device:
        devices = [devices[0]] * args.ranks
    elif len(devices) < args.ranks:
        parser.error(f"--ranks {args.ranks} needs as many devices; this process has "
                     f"{len(devices)} (XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    devices = devices[:args.ranks]
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))
    offload = OffloadConfig(hot_slots=args.hot_slots, page_size=args.page_size,
                            capacity=args.capacity, policy="ring")
    meta = run_metadata()
    rows = []
    for seed in args.seeds:
        rows += run_seed(args, config, params, offload, devices, seed, meta,
                         warm=seed == args.seeds[0])
    write_jsonl(args.out, rows)
    print(table(rows))
    return rows


def run_seed(args, config, params, offload, devices, seed, meta, *, warm):
    """The rows of one seed's stream, one per rule."""
    requests = stream(args.requests, rate=args.rate, short=args.short, long=args.long,
                      long_share=args.long_share, output_len=args.output_len,
                      vocab=config.vocab_size, seed=seed)
    rows, reference = [], None
    # A first, untimed pass compiles what the warm-up request did not reach (later decode
    # calls' programs, eager ops).
    for i, rule in enumerate(([args.rules[0]] if warm else []) + args.rules):
        settings = dict(seats=args.seats, offload=offload, prefill_chunk=args.capacity,
                        decode_steps_per_call=args.decode_steps_per_call, query_block=None)
        if args.engine == "sharded":
            mesh, rules = (sharding.expert_mesh(len(devices), expert=len(devices))
                           if config.n_routed_experts else (sharding.make_mesh(len(devices)),
                                                            None))
            engine = ShardedEngine(params, config, mesh=mesh, rules=rules, placement=rule,
                                   **settings)
        else:
            engine = DataParallelEngine(params, config, devices=devices, placement=rule,
                                        **settings)
        figures, tokens = serve(engine, requests)
        if args.engine != "sharded":
            engine.close()
        if warm and i == 0:
            continue
        # A request's tokens never depend on its rank or neighbours: every rule agrees.
        reference = tokens if reference is None else reference
        figures["same_tokens_as_first_rule"] = tokens == reference
        rows.append({**meta, "question": "dp_serving", "engine": args.engine,
                     "model": args.model, "rule": rule, "ranks": args.ranks,
                     "same_device": args.same_device, "requests": args.requests,
                     "rate": args.rate, "short": args.short, "long": args.long,
                     "long_share": args.long_share, "output_len": args.output_len,
                     "seats": args.seats, "capacity": args.capacity,
                     "hot_slots": args.hot_slots, "page_size": args.page_size,
                     "topk": config.index_topk, "seed": seed, **figures})
        print(f"seed {seed}, {rule}: {figures['wall_s']:.1f} s, spread "
              f"{figures['spread']:.3f}", flush=True)
    return rows


if __name__ == "__main__":
    main()
